"""The end of a run, made safe: exports written whole, a run finished only when they are, links
in the run directory never written through, and a full disk said in one line.

A kill is simulated in the process: the writer of :mod:`effijax.atomic` writes half of a chosen
file and raises an exception no code catches (as SIGKILL would stop it there). The same config
then completes the run's end, and its exports are byte-equal to an uninterrupted run's.
"""

import errno
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from effijax import atomic
from effijax.checkpoint import ROOM_FILE, lock_run_dir
from effijax.cli import main
from effijax.errors import ConfigError, WriteError
from effijax.recipe import TrainConfig, train
from effijax.recipe._report import summary_step

TINY = dict(model="tiny", seq_len=16, batch_size=2, eval_batches=1, progress=False, steps=3,
            checkpoint_every=2)
LORA = dict(TINY, lora_rank=2, lora_random_base=True)
EXPORTS = ("adapters.safetensors", "peft/adapter_config.json", "peft/adapter_model.safetensors")


class Killed(BaseException):
    """Stands for SIGKILL: nothing catches it."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    lines = (f"def f{i}(x):\n    return x + {i}\n" for i in range(300))
    return str(atomic.write_text(tmp_path_factory.mktemp("data") / "corpus.txt", "".join(lines)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """An uninterrupted LoRA run: the exports every completed end must equal."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    assert train(TrainConfig(data=corpus, out=str(out), **LORA)).status == "done"
    return out


def _kill_while_writing(monkeypatch, name: str) -> None:
    """The next write of a file called ``name`` stops half-way through, as a kill would."""
    write_bytes, write_all = atomic.write_bytes, atomic._write_all
    current = {}

    def tracked(path, data, **kw):
        current["name"] = Path(path).name
        return write_bytes(path, data, **kw)

    def half(fd, data):
        if current.get("name") == name:
            write_all(fd, data[: len(data) // 2])
            raise Killed(name)
        write_all(fd, data)

    monkeypatch.setattr(atomic, "write_bytes", tracked)
    monkeypatch.setattr(atomic, "_write_all", half)


def _complete_looking(out: Path) -> list[str]:
    """The exports and summary in place (a hidden temporary name is not in place)."""
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(out).parts)
                  and p.parts[len(out.parts)] in ("adapters.safetensors", "peft",
                                                  "summary.json"))


# A kill at each write of the run's end ---------------------------------------------------------

@pytest.mark.slow  # a reference LoRA run, then a killed run and its completion for each
@pytest.mark.parametrize("name", ["adapters.safetensors", "adapter_model.safetensors",
                                  "loss.png", "summary.json"])
def test_a_run_killed_in_its_end_is_completed_by_the_same_config(
        tmp_path, corpus, reference, monkeypatch, capsys, name):
    out = tmp_path / "run"
    config = TrainConfig(data=corpus, out=str(out), **LORA)
    with monkeypatch.context() as patch:
        _kill_while_writing(patch, name)
        with pytest.raises(Killed):
            train(config)
    # Nothing half-written looks complete: each export is in place whole or not at all.
    done = _complete_looking(out)
    assert "summary.json" not in done
    for file in done:
        assert (out / file).read_bytes() == (reference / file).read_bytes(), file
    assert not (out / "peft").exists() or "peft/adapter_model.safetensors" in done
    capsys.readouterr()
    result = train(config)
    assert result.status == "done"
    assert "(the run's end completed)" in capsys.readouterr().out
    for file in EXPORTS:
        assert (out / file).read_bytes() == (reference / file).read_bytes(), file
    assert not [p.name for p in out.iterdir() if p.name.endswith((".tmp", ".old"))]
    assert not (out / ROOM_FILE).exists()
    assert train(config).status == "finished_before"


@pytest.mark.slow  # the reference LoRA run and a resume of a copy
def test_a_finished_run_missing_an_export_writes_it_again(tmp_path, reference, corpus):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    config = TrainConfig(data=corpus, out=str(out), **LORA)
    shutil.rmtree(out / "peft")  # as an export killed before it was renamed into place
    assert train(config).status == "done"
    for file in EXPORTS:
        assert (out / file).read_bytes() == (reference / file).read_bytes(), file


# Links planted in the run directory ------------------------------------------------------------

@pytest.mark.parametrize("name", [".config.json.tmp", ".metrics.jsonl.tmp", "metrics.jsonl",
                                  ".effijax.lock", "error.log"])
def test_a_run_directory_with_a_planted_link_is_refused(tmp_path, corpus, name):
    out, outside = tmp_path / "run", tmp_path / "outside.txt"
    out.mkdir()
    outside.write_text("precious")
    os.symlink(outside, out / name)
    with pytest.raises(ConfigError, match=f"holds what effijax never writes there: "
                       rf"{name} -> {outside} \(a symbolic link\)"):
        train(TrainConfig(data=corpus, out=str(out), **TINY))
    assert outside.read_text() == "precious"


def _outside_dir(out):
    """A folder outside the run directory with a file in it, and the run directory."""
    outside = out.parent / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("precious")
    out.mkdir()
    return outside


def _link_checkpoints(out, outside):
    os.symlink(outside, out / "checkpoints")
    return "checkpoints -> {outside} (a symbolic link)"


def _link_a_step(out, outside):
    (out / "checkpoints").mkdir()
    os.symlink(outside, out / "checkpoints" / "2")
    return "checkpoints/2 -> {outside} (a symbolic link)"


def _hard_link_the_lock(out, outside):
    os.link(outside / "precious.txt", out / ".effijax.lock")
    return ".effijax.lock (a file with 2 names: hard links to it are elsewhere)"


def _hard_link_the_metrics(out, outside):
    os.link(outside / "precious.txt", out / "metrics.jsonl")
    return "metrics.jsonl (a file with 2 names"


def _fifo_summary(out, outside):
    os.mkfifo(out / "summary.json")
    return "summary.json (a FIFO, where effijax writes a file)"


@pytest.mark.parametrize("plant", [_link_checkpoints, _link_a_step, _hard_link_the_lock,
                                   _hard_link_the_metrics, _fifo_summary])
def test_a_run_directory_holding_what_effijax_never_writes_is_refused(tmp_path, corpus, plant):
    out = tmp_path / "run"
    outside = _outside_dir(out)
    said = plant(out, outside).format(outside=outside)
    with pytest.raises(ConfigError, match="holds what effijax never writes there: .*"
                       + re.escape(said)):
        train(TrainConfig(data=corpus, out=str(out), **TINY))
    assert [p.name for p in outside.iterdir()] == ["precious.txt"]
    assert (outside / "precious.txt").read_text() == "precious"


def test_a_new_run_directory_keeps_an_export_folder_it_did_not_write(tmp_path, corpus):
    out = tmp_path / "run"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "mine.txt").write_text("mine")
    with pytest.raises(ConfigError, match=re.escape("holds hf/ but no effijax run (no "
                                                    "config.json): the run's exports would "
                                                    "replace them")):
        train(TrainConfig(data=corpus, out=str(out), **TINY))
    assert (out / "hf" / "mine.txt").read_text() == "mine"


def test_the_finished_check_never_blocks_on_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "summary.json")
    seen = []
    reader = threading.Thread(target=lambda: seen.append(summary_step(tmp_path)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "summary_step opened the FIFO and waits for a writer"
    assert seen == [None]


def test_the_lock_never_opens_a_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    (tmp_path / "run").mkdir()
    os.symlink(outside, tmp_path / "run" / ".effijax.lock")
    with pytest.raises(ConfigError, match="lock file .effijax.lock is a symbolic link"):
        lock_run_dir(tmp_path / "run")
    assert outside.read_text() == "precious"


@pytest.mark.slow  # a run (about 15 s on 2 shared cores)
def test_a_link_at_a_replaced_file_is_replaced_never_written_through(tmp_path, corpus):
    out, outside = tmp_path / "run", tmp_path / "outside.png"
    out.mkdir()
    outside.write_bytes(b"precious")
    os.symlink(outside, out / "loss.png")
    os.symlink(outside, out / "summary.json")
    assert train(TrainConfig(data=corpus, out=str(out), **TINY, checkpoints=False)).status == \
        "done"
    assert outside.read_bytes() == b"precious"
    assert not (out / "loss.png").is_symlink() and (out / "loss.png").stat().st_size > 1000
    assert not (out / "summary.json").is_symlink()


def test_atomic_writes_replace_a_link_and_keep_the_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "a.json"
    atomic.write_text(target, "old")
    outside = tmp_path / "outside"
    outside.write_text("precious")
    os.symlink(outside, tmp_path / ".a.json.tmp")

    def full(fd, data):
        os.write(fd, data[:2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "_write_all", full)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_text(target, "new text")
    assert target.read_text() == "old" and outside.read_text() == "precious"
    assert not (tmp_path / ".a.json.tmp").exists()


def test_a_directory_export_is_in_place_whole_or_not_at_all(tmp_path):
    final = tmp_path / "hf"
    atomic.write_text(atomic.fresh_dir(final) / "config.json", "1")
    atomic.replace_dir(tmp_path / ".hf.tmp", final)
    tmp = atomic.fresh_dir(final)
    atomic.write_text(tmp / "half.safetensors", "x")  # killed here: the old export stays
    assert sorted(p.name for p in final.iterdir()) == ["config.json"]
    atomic.write_text(atomic.fresh_dir(final) / "model.safetensors", "2")  # starts afresh
    atomic.replace_dir(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# A full disk -----------------------------------------------------------------------------------

def _args(out, corpus, *extra):
    return ["train", "--model", "tiny", "--seq-len", "16", "--batch-size", "2",
            "--eval-batches", "1", "--no-progress", "--steps", "3", "--data", corpus,
            "--out", str(out), *extra]


def _disk_full_at(monkeypatch, name: str, after: int = 0) -> None:
    """Writes to ``name`` (appended or replaced) fail with ENOSPC after ``after`` of them."""
    real_open, calls = os.open, {"n": 0}

    def full_open(path, flags, *args, **kw):
        if Path(path).name in (name, f".{name}.tmp") and flags & os.O_WRONLY:
            calls["n"] += 1
            if calls["n"] > after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(atomic.os, "open", full_open)


@pytest.mark.slow  # a run each (about 12-15 s on 2 shared cores)
@pytest.mark.parametrize("name, after, extra", [
    ("metrics.jsonl", 1, ()),
    ("adapter_model.safetensors", 0, ("--lora-rank", "2", "--lora-random-base")),
    ("summary.json", 0, ("--no-checkpoints",)),
])
def test_a_full_disk_is_one_line_with_the_traceback_in_error_log(
        tmp_path, corpus, monkeypatch, capsys, name, after, extra):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        _disk_full_at(patch, name, after)
        assert main(_args(out, corpus, *extra)) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("effijax train: error: writing ") and name in err[0], err
    assert "[Errno 28] No space left on device (traceback in " in err[0], err
    assert "Traceback (most recent call last)" in (out / "error.log").read_text()
    assert not (out / "summary.json").exists() and not (out / "peft").exists()


def test_a_truncated_adapter_file_is_one_line_not_a_safetensors_traceback(tmp_path):
    import jax
    import jax.numpy as jnp

    from effijax import lora

    spec = lora.LoraSpec(rank=2, targets="w")
    file = tmp_path / "adapters.safetensors"
    lora.save_adapters(file, lora.init(jax.random.key(0), {"w": jnp.zeros((4, 4))}, spec), spec)
    file.write_bytes(file.read_bytes()[:-20])  # what an older effijax, killed, left
    with pytest.raises(ConfigError, match="is not a whole safetensors file .*; write it again"):
        lora.load_adapters(file)


def test_write_error_names_the_file(tmp_path):
    from effijax.checkpoint import write_errors

    with pytest.raises(WriteError, match="writing .*metrics.jsonl failed: .*No space"):
        with write_errors(tmp_path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "metrics.jsonl"))


def test_truncating_metrics_on_a_full_disk_is_a_write_error_naming_the_file(
        tmp_path, monkeypatch):
    from effijax.checkpoint import truncate_metrics

    metrics = tmp_path / "metrics.jsonl"
    before = "".join(f'{{"step": {i}, "loss": 1.0}}\n' for i in (1, 2, 3))
    metrics.write_text(before)

    def full(fd, data):
        os.write(fd, data[:5])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "_write_all", full)
    with pytest.raises(WriteError) as caught:
        truncate_metrics(metrics, 1)
    assert str(caught.value) == (f"writing {metrics} failed: [Errno 28] No space left on device "
                                 f"(traceback in {tmp_path / 'error.log'})")
    assert metrics.read_text() == before  # the file as it was
    assert "Traceback (most recent call last)" in (tmp_path / "error.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.log", "metrics.jsonl"]


@pytest.mark.parametrize("argv", [["memory", "--from", "{run}"],
                                  ["train", "--from", "{run}", "--steps", "1", "--out", "{new}"]])
def test_a_huge_run_config_json_is_refused_unread(tmp_path, capsys, argv):
    """A run directory's config.json of 3 GB (sparse: nothing is written) ends in one line,
    read neither whole nor at all."""
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "config.json", "wb") as f:
        f.truncate(3 * 10**9)
    (run / "checkpoints").mkdir()
    argv = [a.format(run=run, new=tmp_path / "new") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert f"{run / 'config.json'}: file: is 3,000,000,000 bytes; expected at most 1,048,576" \
        in err, err
