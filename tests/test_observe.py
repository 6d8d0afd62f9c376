"""Watching a run: TensorBoard events, an offline W&B run and a profiler trace, each read back
with the reader of the library that wrote it, across a resume."""

import errno
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from effijax.errors import ConfigError, WriteError
from effijax.observe import Profiler, Sinks, TensorBoardSink, scalars
from effijax.recipe import TrainConfig, train
from effijax.run import read_metrics

TINY = dict(model="tiny", seq_len=16, batch_size=2, eval_batches=1, progress=False,
            checkpoint_every=2)
STEP_TAGS = ("train/loss", "train/learning_rate", "train/loss_scale", "train/skipped",
             "train/grad_norm", "train/tokens_per_s")


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _raw_losses(logdir):
    """Every train/loss value in the event files as written, duplicates included."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    values, starts = [], []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                starts.append(event.step)
            for v in event.summary.value:
                if v.tag == "train/loss":
                    values.append(event.step)
    return values, starts


def test_tensorboard_holds_one_value_per_step_across_a_resume(tmp_path):
    pytest.importorskip("tensorboardX", reason="the tensorboard extra is not installed")
    pytest.importorskip("tensorboard", reason="tensorboard (the reader) is not installed")
    out = tmp_path / "run"
    cfg = TrainConfig(**TINY, steps=6, tensorboard=True, out=str(out))
    train(cfg)
    # A run killed after it logged step 6 but before checkpoint 6 was committed: what is on
    # disk is checkpoints 2 and 4, and events up to step 6.
    shutil.rmtree(out / "checkpoints" / "6")
    result = train(cfg)
    assert result.status == "done" and result.summary["start_step"] == 4

    logdir = out / "tensorboard"
    written, starts = _raw_losses(logdir)
    assert written == [1, 2, 3, 4, 5, 6, 5, 6]  # steps 5 and 6 ran (and were logged) twice
    assert starts == [5]  # the resumed writer declares where its stream restarts
    events = _scalars(logdir)
    metrics = read_metrics(out)
    for tag in STEP_TAGS:
        assert [e.step for e in events.Scalars(tag)] == [1, 2, 3, 4, 5, 6], tag
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(
        [r["loss"] for r in metrics], rel=1e-6)
    assert [e.value for e in events.Scalars("train/learning_rate")] == pytest.approx(
        [r["learning_rate"] for r in metrics], rel=1e-6)
    (ev,) = events.Scalars("eval/loss")
    assert ev.step == 6 and ev.value == pytest.approx(result.summary["eval_loss"], rel=1e-6)
    text = {tag: events.Tensors(tag) for tag in events.Tags()["tensors"]}
    memory = text["memory/text_summary"][0].tensor_proto.string_val[0].decode()
    assert memory.startswith("| per device | bytes |") and "| params |" in memory
    config = text["config/text_summary"][0].tensor_proto.string_val[0].decode()
    assert '"tensorboard": true' in config


def _wandb_records(run_dir):
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                           str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_offline_wandb_run_holds_metrics_and_config_and_a_resume_continues_it(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    out = tmp_path / "run"
    cfg = TrainConfig(**TINY, steps=4, wandb="effijax-tests", wandb_mode="offline",
                      out=str(out))
    train(cfg)
    run_id = (out / "wandb_run_id").read_text()
    result = train(cfg.with_overrides(steps=6, allow_changes="steps"))  # trained further
    assert result.summary["start_step"] == 4 and (out / "wandb_run_id").read_text() == run_id

    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, "each start writes its part of the one W&B run"
    metrics = read_metrics(out)
    history, config, summary = {}, {}, {}
    for run in runs:
        for record in _wandb_records(run):
            if record["type"] == "run":
                assert record["run"]["run_id"] == run_id and record["run"]["project"] == \
                    "effijax-tests"
                config.update(record["run"]["config"]["update"])
            elif record["type"] == "history":
                item = record["history"]["item"]
                if "train/loss" in item:
                    history.setdefault(int(item["_step"]), []).append(item)
            elif record["type"] == "summary":
                summary.update(record["summary"].get("update", {}))
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    assert all(len(v) == 1 for v in history.values())
    for r in metrics:
        item = history[r["step"]][0]
        assert item["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert item["train/grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6)
        assert "train/tokens_per_s" in item and "train/loss_scale" in item
    # The config as the latest start saw it (trained further: steps=6), with the run record.
    assert config["steps"] == 6 and config["model"] == "tiny" and "run" in config
    assert summary["eval/loss"] == pytest.approx(result.summary["eval_loss"], rel=1e-6)


def test_a_profile_of_two_steps_is_a_trace_the_profiler_reads(tmp_path, capsys):
    out = tmp_path / "run"
    train(TrainConfig(**TINY, steps=4, checkpoints=False, profile_steps="2:3", out=str(out)))
    (trace,) = sorted((out / "profile").glob("plugins/profile/*/*.xplane.pb"))
    # Beside it, the compiled step's time by kind of work, as the run printed it.
    said = capsys.readouterr().out
    breakdown = (trace.parent / "breakdown.md").read_text()
    assert breakdown.startswith("The compiled step's time by kind of work (steps 2-3, ")
    assert f"effijax train: t{breakdown[1:].splitlines()[0]}" in said
    rows = [line.split(" | ")[0].strip("| ") for line in breakdown.splitlines()
            if line.startswith("| ") and not line.startswith("| category")]
    assert {"matmuls", "attention", "head and loss", "optimizer update", "idle"} <= set(rows)
    assert trace.stat().st_size > 0
    data = jax.profiler.ProfileData.from_file(str(trace))
    steps = sorted(int(dict(ev.stats)["step_num"]) for plane in data.planes
                   for line in plane.lines for ev in line.events if ev.name == "train")
    assert steps == [2, 3]
    # The device work of the traced steps is inside: the compiled step ran in the trace.
    names = {ev.name for plane in data.planes for line in plane.lines for ev in line.events}
    assert any("train_step" in n or "jit" in n.lower() for n in names), sorted(names)[:20]
    with gzip.open(trace.parent / "perfetto_trace.json.gz") as f:
        assert json.load(f)["traceEvents"]


def test_a_resume_past_the_profiled_steps_traces_nothing_again(tmp_path):
    prof = Profiler(tmp_path, 2, 3, start_step=3)
    step = prof.wrap(lambda x: x + 1)
    assert step(1) == 2 and not prof.tracing
    prof.close()
    assert prof.trace_files() == []
    prof = Profiler(tmp_path, 2, 5, start_step=3)  # resumed inside the range: steps 4 and 5
    step = prof.wrap(lambda x: x + 1)
    step(0)
    assert prof.tracing
    step(0)
    assert not prof.tracing and len(prof.trace_files()) == 1


def test_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match=r"profile_steps='3:9': ends after the last step"):
        TrainConfig(steps=5, profile_steps="3:9")
    with pytest.raises(ConfigError, match=r"profile_steps='x': expected A:B"):
        TrainConfig(profile_steps="x")
    with pytest.raises(ConfigError, match=r"wandb_mode='offline': only applies with --wandb"):
        TrainConfig(wandb_mode="offline")
    with pytest.raises(ConfigError, match=r"cluster='pbs': choose one of"):
        TrainConfig(cluster="pbs")
    assert TrainConfig(profile_steps="4").profile_range == (4, 4)


def test_sinks_get_the_numbers_of_each_record_and_all_close():
    calls = []

    class Recorder:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def log(self, record):
            calls.append((self.name, record["step"], scalars(record)))

        def values(self, step, values):
            calls.append((self.name, step, dict(values)))

        def text(self, tag, text, step):
            calls.append((self.name, tag, text))

        def close(self):
            calls.append((self.name, "closed"))
            if self.fail:
                raise OSError("disk full")

    sinks = Sinks([Recorder("a", fail=True), Recorder("b")])
    sinks.log({"step": 2, "loss": 1.5, "skipped": True, "grads_finite": False, "tag": "x"})
    assert calls == [(n, 2, {"train/loss": 1.5, "train/skipped": 1.0,
                             "train/grads_finite": 0.0}) for n in "ab"]
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        sinks.close()
    assert calls == [("a", "closed"), ("b", "closed")]  # b is closed although a failed


# The run directory is ours: no write through a planted link, a full disk in one line ----------

def _full_disk_for(monkeypatch, part: str, after: int = 0) -> None:
    """Opening a file whose name holds ``part`` for writing fails with ENOSPC after ``after``
    such opens (as a full disk would, at the next write)."""
    real_open, calls = os.open, {"n": 0}

    def full_open(path, flags, *args, **kw):
        if part in Path(path).name and flags & os.O_WRONLY:
            calls["n"] += 1
            if calls["n"] > after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", full_open)


@pytest.fixture(scope="module")
def tensorboardx():
    """tensorboardX, imported once (it imports torch when installed: seconds)."""
    pytest.importorskip("tensorboard", reason="tensorboard (the reader) is not installed")
    return pytest.importorskip("tensorboardX", reason="the tensorboard extra is not installed")


def test_a_link_planted_at_the_tensorboard_folder_is_refused(tmp_path, tensorboardx):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    os.symlink(outside, tmp_path / "run" / "tensorboard")
    with pytest.raises(ConfigError, match=r"^out='.*/run': holds a symbolic link where effijax "
                       rf"writes \(tensorboard -> {outside}\); .*: remove it$"):
        TensorBoardSink(tmp_path / "run" / "tensorboard")
    assert list(outside.iterdir()) == []


def test_an_event_file_is_never_opened_through_a_link(tmp_path, tensorboardx):
    logdir, outside = tmp_path / "run" / "tensorboard", tmp_path / "outside"
    logdir.mkdir(parents=True)
    outside.write_bytes(b"precious")
    now = int(time.time())  # links at every name the sink may pick in the next seconds
    for t in range(now - 1, now + 30):
        os.symlink(outside, logdir / f"events.out.tfevents.{t}.{socket.gethostname()}")
    sink = TensorBoardSink(logdir)
    sink.log({"step": 1, "loss": 2.5})
    sink.close()
    assert outside.read_bytes() == b"precious"
    assert not sink.path.is_symlink() and sink.path.name.endswith(".1")
    assert [(e.step, e.value) for e in _scalars(sink.path).Scalars("train/loss")] == [(1, 2.5)]


def test_a_full_disk_under_tensorboard_is_one_write_error(tmp_path, monkeypatch, capfd,
                                                         tensorboardx):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = tmp_path / "run"
    _full_disk_for(monkeypatch, "tfevents", after=2)  # its creation and first write go through
    sink = TensorBoardSink(out / "tensorboard")
    sink.log({"step": 1, "loss": 2.5})
    with pytest.raises(WriteError) as caught:
        sink.close()
    assert str(caught.value) == (f"writing {sink.path} failed: [Errno 28] No space left on "
                                 f"device (traceback in {out / 'error.log'})")
    assert "Traceback (most recent call last)" in (out / "error.log").read_text()
    sink.close()  # nothing more is written, nothing more raised
    monkeypatch.undo()
    assert [e.file_version for e in EventFileLoader(str(sink.path)).Load()] == ["brain.Event:2"]
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize("link", ["profile", "profile/plugins",
                                  "profile/plugins/profile/2026_01_01_00_00_00"])
def test_a_link_planted_where_the_profiler_writes_is_refused(tmp_path, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run" / link).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, tmp_path / "run" / link)
    prof = Profiler(tmp_path / "run" / "profile", 1, 1)
    step = prof.wrap(lambda x: x + 1)
    with pytest.raises(ConfigError, match=rf"holds a symbolic link where effijax writes "
                       rf"\({link} -> {outside}\)"):
        step(1)
    assert not prof.tracing and list(outside.iterdir()) == []


def test_a_full_disk_while_the_profile_is_written_is_one_write_error(tmp_path, monkeypatch):
    out = tmp_path / "run"
    prof = Profiler(out / "profile", 1, 1)
    step = prof.wrap(jax.jit(lambda x: x + 1))
    _full_disk_for(monkeypatch, "perfetto_trace.json.gz")
    with pytest.raises(WriteError, match=r"^writing .*/\.?perfetto_trace\.json\.gz(\.tmp)? "
                       r"failed: \[Errno "
                       rf"28\] No space left on device \(traceback in {out / 'error.log'}\)$"):
        step(1)
    monkeypatch.undo()
    assert len(prof.trace_files()) == 1 and not prof.tracing  # the trace itself was written
    assert not list(out.glob("profile/plugins/profile/*/*perfetto*"))  # nothing half-written


@pytest.mark.slow  # a run (about 12 s on 2 shared cores)
def test_a_full_disk_under_tensorboard_ends_the_run_in_one_line(tmp_path, monkeypatch, capfd,
                                                                 tensorboardx):
    from effijax.cli import main

    out = tmp_path / "run"
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    _full_disk_for(monkeypatch, "tfevents", after=1)  # the event file is created, not written
    assert main(["train", "--model", "tiny", "--seq-len", "16", "--batch-size", "2",
                 "--eval-batches", "1", "--no-progress", "--steps", "3", "--no-checkpoints",
                 "--tensorboard", "--data", str(tmp_path / "corpus.txt"),
                 "--out", str(out)]) == 1
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("effijax train: error: writing "), err
    assert "tfevents" in err[0] and "[Errno 28] No space left on device (traceback in " in err[0]
    assert "Traceback (most recent call last)" in (out / "error.log").read_text()
