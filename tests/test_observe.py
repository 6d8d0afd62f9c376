"""Watching a run: TensorBoard events, an offline W&B run and a profiler trace, each read back
with the reader of the library that wrote it, across a resume."""

import gzip
import json
import shutil
import subprocess
import sys

import jax
import pytest

from effijax.errors import ConfigError
from effijax.observe import Profiler, Sinks, scalars
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


def test_a_profile_of_two_steps_is_a_trace_the_profiler_reads(tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(**TINY, steps=4, checkpoints=False, profile_steps="2:3", out=str(out)))
    (trace,) = sorted((out / "profile").glob("plugins/profile/*/*.xplane.pb"))
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
