"""What goes wrong around a run: damaged checkpoints, a shared run directory, changed settings,
malformed run files. Each case ends in one clear line and the right exit code, and a damaged
step is set aside, never deleted.

One tiny run (checkpoints at steps 2, 4, 6) is shared; each test copies it. Dropping step 6
makes a copy look like a run stopped at step 4, which the same command resumes.
"""

import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _compiles import compiles
from _damage import truncate_largest_array_file
from _run_env import compiles_as_the_suite

from effijax.checkpoint import FORMAT_VERSION, lock_run_dir, open_checkpoints, restore_target
from effijax.cli import main

TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
        "--no-progress", "--checkpoint-every", "2", "--keep", "10"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    return str(path)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("runs") / "base"
    assert main(["train", "--steps", "6", "--data", corpus, "--out", str(out), *TINY]) == 0
    return out


def _args(out, corpus, *extra):
    return ["train", "--steps", "6", "--data", corpus, "--out", str(out), *TINY, *extra]


@pytest.fixture
def stopped(tmp_path, finished):
    """A copy of the run as if it had stopped after step 4."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "checkpoints" / "6")
    return out


def _garble_metadata(step_dir: Path) -> None:
    f = step_dir / "state" / "_METADATA"
    data = bytearray(f.read_bytes())
    data[len(data) // 2: len(data) // 2 + 8] = b"\xff" * 8
    f.write_bytes(bytes(data))


def _drop_metadata(step_dir: Path) -> None:
    (step_dir / "_CHECKPOINT_METADATA").unlink()


def _leaves(out, step):
    """Every leaf of ``step`` on the host (PRNG keys as key data)."""
    from effijax.models import model_from_dict
    from effijax.recipe import TrainConfig, abstract_state, optimizer_for

    directory = Path(out) / "checkpoints"
    with open_checkpoints(directory, every=1, keep=None) as ckpt:
        saved = ckpt.metadata(step)["metadata"]["config"]
        s = TrainConfig.from_dict(saved).sections
        abstract = abstract_state(model_from_dict(saved["run"]["model_config"]),
                                  s.precision.precision,
                                  optimizer_for(s.training, s.optimizer, s.precision),
                                  seed=s.training.seed)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        state = ckpt.restore(step, target_state_abstract=restore_target(abstract, device))
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(state)]


# Damaged checkpoints ----------------------------------------------------------------------------

@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
@pytest.mark.parametrize("damage, reason", [
    (truncate_largest_array_file, "step 4"),
    (_garble_metadata, "metadata cannot be read"),
    (_drop_metadata, "has no effijax record"),
])
def test_a_damaged_newest_step_is_set_aside_and_the_run_resumes_from_the_previous(
        stopped, corpus, finished, capsys, caplog, damage, reason):
    damage(stopped / "checkpoints" / "4")
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="absl"):
        assert main(_args(stopped, corpus)) == 0
    # effijax's line is the only report: orbax's own warnings about the step stay quiet.
    assert not [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and "checkpoints/4" in r.getMessage()]
    captured = capsys.readouterr()
    warning = [x for x in captured.err.splitlines() if "cannot be restored" in x]
    assert len(warning) == 1, captured.err
    assert "checkpoint step 4 in" in warning[0] and reason in warning[0], warning
    assert "moved it to 4.corrupt-1 and resuming from step 2" in warning[0]
    assert "resuming from step 2" in captured.out
    steps = sorted(p.name for p in (stopped / "checkpoints").iterdir())
    assert steps == ["2", "4", "4.corrupt-1", "6"]  # the damaged step is kept for inspection
    # Resumed from step 2, the run ends bitwise where the uninterrupted one did.
    for a, b in zip(_leaves(stopped, 6), _leaves(finished, 6), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
def test_no_intact_step_is_one_line_naming_what_to_remove(stopped, corpus, capsys):
    for step in ("2", "4"):
        _drop_metadata(stopped / "checkpoints" / step)
    capsys.readouterr()
    assert main(_args(stopped, corpus)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("effijax train: error: checkpoint=")
    assert "no checkpoint step restores (step 4: " in err[0] and "step 2: " in err[0]
    assert f"remove {stopped / 'checkpoints'}" in err[0]
    # Nothing was moved: the steps are where they were.
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["2", "4"]


@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
def test_init_from_a_run_with_a_damaged_newest_step_starts_from_the_previous(
        tmp_path, finished, corpus, capsys):
    source = tmp_path / "source"
    shutil.copytree(finished, source)
    truncate_largest_array_file(source / "checkpoints" / "6")
    before = sorted(p.name for p in (source / "checkpoints").iterdir())
    out = tmp_path / "tuned"
    capsys.readouterr()
    assert main(["train", "--from", str(source), "--steps", "2", "--data", corpus,
                 "--out", str(out), *TINY[4:]]) == 0
    err = capsys.readouterr().err
    assert f"--from: step 6 in {source / 'checkpoints'} cannot be restored" in err, err
    assert "starting from step 4" in err
    record = json.loads((out / "config.json").read_text())["run"]
    assert record["init_from_checkpoint"] == {"run": str(source.resolve()), "step": 4}
    assert sorted(p.name for p in (source / "checkpoints").iterdir()) == before  # untouched
    for step in ("2", "4"):
        _drop_metadata(source / "checkpoints" / step)
    assert main(["train", "--from", str(source), "--steps", "2", "--data", corpus,
                 "--out", str(tmp_path / "never"), *TINY[4:]]) == 2
    err = capsys.readouterr().err
    assert "--from=" in err and "no checkpoint step restores (step 6:" in err, err


@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
def test_a_newer_checkpoint_format_is_refused_naming_both_versions(stopped, corpus, capsys):
    meta = stopped / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
    content = json.loads(meta.read_text())
    content["custom_metadata"]["effijax"]["format"] = 99
    meta.write_text(json.dumps(content))
    capsys.readouterr()
    assert main(_args(stopped, corpus)) == 2
    err = capsys.readouterr().err
    assert (f"step 4 is in checkpoint format 99, newer than this effijax reads (format "
            f"{FORMAT_VERSION}); upgrade effijax") in err, err


# The lock -----------------------------------------------------------------------------------------

@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
def test_a_second_run_into_a_locked_directory_is_refused_naming_the_holder(
        stopped, corpus, capsys):
    with lock_run_dir(stopped):
        capsys.readouterr()
        with compiles() as compiled:
            assert main(_args(stopped, corpus)) == 2
        err = capsys.readouterr().err
    assert f"--out='{stopped.resolve()}': another run is writing this directory (host " in err
    assert f"pid {os.getpid()}, since " in err, err
    assert compiled == []  # before anything compiles
    # Nothing was touched: the directory still resumes from step 4.
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["2", "4"]


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import sys, time; from effijax.checkpoint import lock_run_dir; "
            "lock = lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(60)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(Exception, match=f"pid {proc.pid}"):
            lock_run_dir(tmp_path)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    with lock_run_dir(tmp_path) as held:  # the kernel released it with the process
        assert held.held


# Changed settings on resume -----------------------------------------------------------------------

@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
def test_a_resume_with_other_settings_is_refused_listing_each(stopped, corpus, tmp_path,
                                                              capsys):
    other = tmp_path / "other.txt"
    other.write_text("".join(f"x{i} = {i} * 2\n" for i in range(600)))
    args = _args(stopped, str(other), "--seed", "7", "--precision", "bf16", "--lr", "1e-4")
    i = args.index("--batch-size")
    args[i + 1] = "4"
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for part in ("data '", "seed 0 -> 7 (must match", "batch_size 2 -> 4 (must match",
                 "precision 'fp32' -> 'bf16' (must match",
                 "lr 0.003 -> 0.0001 (add --allow-changes lr to accept)"):
        assert part in err[0], (part, err[0])
    # The changeable one alone passes with the override, and config.json keeps the original.
    original = json.loads((stopped / "config.json").read_text())
    assert main(_args(stopped, corpus, "--lr", "1e-4")) == 2
    assert main(_args(stopped, corpus, "--lr", "1e-4", "--allow-changes", "lr")) == 0
    written = json.loads((stopped / "config.json").read_text())
    assert written["lr"] == original["lr"] == 0.003
    assert written["run"] == original["run"]
    (resume,) = written["resumes"]
    assert resume["step"] == 4
    assert resume["changed"]["lr"] == [0.003, 0.0001]
    assert main(_args(stopped, corpus, "--allow-changes", "seed")) == 2
    assert "'seed' cannot change on resume" in capsys.readouterr().err


# Malformed run files ------------------------------------------------------------------------------

@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
@pytest.mark.parametrize("change, field, problem", [
    ({"n_layers": "2"}, "run.model_config.n_layers", "'2': must be an integer"),
    ({"bogus": 1}, "run.model_config.bogus", "not a GPTConfig field"),
    ({"seq_len": -5}, "run.model_config.seq_len", "-5: must be an integer >= 1"),
])
def test_a_malformed_init_from_config_names_the_file_and_field(
        tmp_path, finished, corpus, capsys, change, field, problem):
    source = tmp_path / "source"
    shutil.copytree(finished, source, ignore=shutil.ignore_patterns("checkpoints"))
    (source / "checkpoints").mkdir()
    values = json.loads((source / "config.json").read_text())
    values["run"]["model_config"].update(change)
    (source / "config.json").write_text(json.dumps(values))
    capsys.readouterr()
    assert main(["train", "--from", str(source), "--steps", "2", "--data", corpus,
                 "--out", str(tmp_path / "x"), *TINY[4:]]) == 2
    err = capsys.readouterr().err
    assert f"{source / 'config.json'}:{field}" in err and problem in err, err
    assert "Traceback" not in err


@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
@pytest.mark.parametrize("change, field, problem", [
    ({"seed": "zero"}, "seed", "expected an integer"),
    ({"steps": -1}, "steps", "must be an integer >= 1"),
    ({"step": 4}, "step", "unknown setting"),
])
def test_a_malformed_config_json_of_the_resumed_run_names_the_file_and_field(
        stopped, corpus, capsys, change, field, problem):
    path = stopped / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    capsys.readouterr()
    assert main(_args(stopped, corpus)) == 2
    err = capsys.readouterr().err
    assert f"{path.resolve()}:{field}=" in err and problem in err, err


@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
def test_a_run_record_edited_by_hand_is_said_and_given_back_its_checkpoints(stopped, corpus,
                                                                           capsys):
    path = stopped / "config.json"
    written = json.loads(path.read_text())
    edited = {**written, "seed": 5, "run": {**written["run"], "corpus_sha256": "0" * 64}}
    path.write_text(json.dumps(edited))
    capsys.readouterr()
    assert main(_args(stopped, corpus)) == 0
    err = capsys.readouterr().err
    assert (f"warning: {path.resolve()} says another run than its checkpoint of step 4 (data, "
            "seed differ: edited by hand?)") in err, err
    now = json.loads(path.read_text())
    assert now["seed"] == written["seed"] and now["run"]["corpus_sha256"] == \
        written["run"]["corpus_sha256"]
    assert [r["step"] for r in now["resumes"]] == [4]


@pytest.mark.slow  # a shared 6-step run, and a resume of a copy
def test_malformed_checkpoint_metadata_is_a_damaged_step(stopped, corpus, capsys):
    meta = stopped / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
    content = json.loads(meta.read_text())
    content["custom_metadata"]["effijax"]["metadata"]["config"]["batch_size"] = "two"
    meta.write_text(json.dumps(content))
    capsys.readouterr()
    assert main(_args(stopped, corpus)) == 0
    err = capsys.readouterr().err
    assert "metadata.config.batch_size='two': expected an integer" in err, err
    assert "moved it to 4.corrupt-1 and resuming from step 2" in err


# Storage and memory pre-flight --------------------------------------------------------------

def test_an_unusable_checkpoint_directory_is_refused_before_compiling(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoints go")
    with compiles() as compiled:
        assert main(_args(out, corpus)) == 2
    err = capsys.readouterr().err
    assert f"--out='{out.resolve() / 'checkpoints'}': cannot hold checkpoints" in err, err
    assert compiled == []
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow  # compiles the step
def test_a_step_over_the_memory_budget_stops_before_step_one(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert main(_args(out, corpus, "--device-memory", "1MB")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("effijax train: error: --device-memory='1 MB': the compiled step "
                             "needs "), err
    for part in ("per device (arguments ", "temporaries ", "more than the 1 MB of "
                 "--device-memory", "or --device-memory 0 to skip this check"):
        assert part in err[0], (part, err[0])
    assert not (out / "metrics.jsonl").exists()  # no step ran


@pytest.mark.slow  # compiles the step three times
def test_the_memory_refusal_suggests_flags_that_fit_and_they_do(tmp_path, corpus, capsys):
    """The suggestion is flags of `effijax train` (not a command that does not exist, nor a
    setting train lacks), and the run they describe passes the same check."""
    args = ["train", "--data", corpus, "--model", "tiny", "--seq-len", "128", "--batch-size",
            "16", "--steps", "4", "--eval-batches", "1", "--no-progress", "--no-checkpoints"]
    # The budget: half of what the step needs, from a first refusal at 1 MB.
    assert main([*args, "--out", str(tmp_path / "a"), "--device-memory", "1MB"]) == 2
    need = float(re.search(r"needs ([\d.]+) MB", capsys.readouterr().err).group(1))
    budget = f"{need / 2:.0f}MB"
    assert main([*args, "--out", str(tmp_path / "b"), "--device-memory", budget]) == 2
    err = capsys.readouterr().err
    suggested = re.search(r"; try (--[^(]+) \(", err)
    assert suggested, err
    flags = shlex.split(suggested.group(1))
    assert flags[0] == "--batch-size" and "--accumulate" in flags and "--steps" in flags, flags
    assert main([*args, "--out", str(tmp_path / "c"), "--device-memory", budget, *flags]) == 0


def test_the_memory_refusal_without_device_memory_does_not_name_the_flag():
    """A budget read from the device is not blamed on a --device-memory the user never gave."""
    import optax

    from effijax.errors import NO_VALUE, ConfigError
    from effijax.models import gpt_config
    from effijax.recipe import plan_job
    from effijax.sharding import MemoryReport
    from effijax.sources import _preflight

    job = plan_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3), batch_size=2)
    huge = MemoryReport(params=10**3, opt_state=2 * 10**3, other_state=8, grads=10**3,
                        arguments=3 * 10**3, outputs=3 * 10**3, temporaries=10**15,
                        aliased=3 * 10**3, peak=None)
    with pytest.raises(ConfigError) as e:
        _preflight.check_compiled_memory(huge, job, None)
    assert e.value.field == "memory" and e.value.value is NO_VALUE
    assert str(e.value).startswith("memory: the compiled step needs 1000000 GB per device"), e.value
    assert "of the host's available memory / 1 local device(s)" in str(e.value)
    assert "--device-memory 0 to skip this check" in str(e.value)


@pytest.mark.slow  # a subprocess that trains until its first checkpoint write fails
def test_a_write_failing_mid_run_ends_in_one_line_with_the_traceback_in_a_log(tmp_path,
                                                                              corpus):
    # RLIMIT_FSIZE makes every write past 64 KB fail with EFBIG, as a full disk fails with
    # ENOSPC: the first checkpoint (about 1.4 MB) fails in orbax's background writer.
    import shlex

    out = tmp_path / "run"
    env = compiles_as_the_suite({**os.environ, "JAX_PLATFORMS": "cpu"})
    command = shlex.join([sys.executable, "-m", "effijax", *_args(out, corpus)])
    # The shell ignores SIGXFSZ (so a write past the limit fails with EFBIG instead of
    # killing the process) and limits file sizes to 64 blocks of 1 KB.
    proc = subprocess.run(["bash", "-c", f"trap '' XFSZ; ulimit -f 64; exec {command}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # The run's last word is one line (orbax's background writers may, racing the shutdown,
    # still print an "Event loop is closed" traceback before it, even into its start).
    err = [proc.stderr.splitlines()[-1].split("effijax train: error: ")[-1]]
    assert proc.stderr.count("effijax train: error:") == 1, proc.stderr[-3000:]
    assert err[0].startswith(f"saving the checkpoint of step 2 to {out.resolve() / 'checkpoints'}"
                             " failed: [Errno 27] File too large (traceback in "), err
    assert "Traceback (most recent call last)" in (out / "error.log").read_text()
    # Nothing restorable was left half-written: no committed step; metrics whole (the run
    # went on until the background write's failure surfaced, at the next save).
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
