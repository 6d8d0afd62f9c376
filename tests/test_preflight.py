"""Pre-flight checks of `effijax train` (storage, memory) and whole metrics records."""

import dataclasses
import json
import os
import shutil
from collections import namedtuple

import optax
import pytest

from effijax.checkpoint import truncate_metrics
from effijax.errors import ConfigError, WriteError
from effijax.models import gpt_config
from effijax.recipe import plan_job
from effijax.run import RunDir, read_metrics
from effijax.sharding import MemoryReport
from effijax.sources import _preflight  # the module under test


def test_storage_refuses_a_file_where_the_checkpoints_go(tmp_path):
    (tmp_path / "checkpoints").write_text("not a directory")
    with pytest.raises(ConfigError, match="is not a directory"):
        _preflight.storage(tmp_path / "checkpoints", 1000, keep=3)


def test_storage_compares_free_space_with_keep_plus_one_checkpoints(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, 3_500))
    _preflight.storage(tmp_path / "checkpoints", 1000, keep=2)  # 3 x 1000 fit in 3500
    with pytest.raises(ConfigError) as info:
        _preflight.storage(tmp_path / "checkpoints", 1000, keep=3)
    assert info.value.field == "out"
    assert ("3.5 KB free there, but 4 checkpoints of 1 KB (--keep 3, plus the one being "
            "written) need 4 KB more; lower --keep to 2, free space") in info.value.problem
    # What it suggests fits (the call above with keep=2); with room for none: no checkpoints.
    with pytest.raises(ConfigError, match="; train with --no-checkpoints, free space"):
        _preflight.storage(tmp_path / "checkpoints", 2000, keep=3)
    # Steps already on disk count towards keep: two of 1000 bytes leave 2000 to find.
    for step in ("2", "4"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
        (tmp_path / "checkpoints" / step / "data").write_bytes(b"x" * 1000)
    _preflight.storage(tmp_path / "checkpoints", 1000, keep=3)


def _report(**bytes_):
    base = dict(params=1000, opt_state=2000, other_state=8, grads=1000, arguments=3008,
                outputs=3008, temporaries=500, aliased=3008, peak=None)
    return MemoryReport(**{**base, **bytes_})


@pytest.fixture(scope="module")
def job():
    return plan_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3), batch_size=2)


def test_step_bytes_counts_arguments_new_outputs_and_temporaries():
    assert _preflight.step_bytes(_report()) == 3008 + 500
    assert _preflight.step_bytes(_report(aliased=0)) == 3008 * 2 + 500


def test_memory_over_budget_stops_with_the_breakdown_and_a_plan(job):
    m = _report(arguments=50_000_000, temporaries=80_000_000, aliased=50_000_000,
                outputs=50_000_000, params=12_000_000, opt_state=24_000_000)
    _preflight.check_compiled_memory(m, job, "1GB")  # fits
    _preflight.check_compiled_memory(m, job, "0")  # skipped
    with pytest.raises(ConfigError) as info:
        _preflight.check_compiled_memory(m, job, "100MB")
    e = info.value
    assert e.field == "device_memory" and e.value == "100 MB"
    assert ("the compiled step needs 130 MB per device (arguments 50 MB + outputs 50 MB - "
            "donated 50 MB + temporaries 80 MB; of the arguments: params 12 MB, optimizer "
            "24 MB), more than the 100 MB of --device-memory") in e.problem
    # Halving the micro-batch leaves 50 + 40 + an accumulator of 12 MB: over 85% of 100 MB.
    assert ("no --strategy or --accumulate change fits 100 MB per device: shorten --seq-len, "
            "or use a device with more memory") in e.problem, e.problem
    # With the temporaries dominating, fewer sequences per step (one device, batch 2) fit.
    with pytest.raises(ConfigError) as info:
        _preflight.check_compiled_memory(dataclasses.replace(m, temporaries=200_000_000), job,
                                         "200MB", 30)
    assert ("; try --batch-size 1 --accumulate 2 --steps 60 (the same sequences per optimizer "
            "update, in smaller micro-batches: about 162 MB per device); or --device-memory 0 "
            "to skip this check") in info.value.problem, info.value.problem
    assert "effijax memory plan" not in e.problem and "remat" not in e.problem


def test_the_advice_to_skip_the_check_is_a_setting_the_config_takes():
    """``--device-memory 0``, which the refusal above advises, passes the config's own checks
    (a bare ``0`` once failed them: "a size needs a unit")."""
    from effijax.recipe import TrainConfig

    for zero in ("0", "0B"):
        assert TrainConfig(device_memory=zero).device_memory == zero
    with pytest.raises(ConfigError, match="a size needs a unit"):
        TrainConfig(device_memory="8")


def test_cpu_budget_is_the_hosts_available_memory_shared_by_its_devices(job, monkeypatch):
    import jax

    # MemAvailable moves between two reads while other tests run: read it, then pin it.
    available = _preflight._meminfo_available()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available <= total
    monkeypatch.setattr(_preflight, "_meminfo_available", lambda: 8 * 1000 + 7)
    budget, source = _preflight.device_budget(jax.devices()[0], None, 8)
    assert source == "the host's available memory / 8 local device(s)"
    assert budget == 1000


def test_a_short_metrics_write_is_undone_and_raised(tmp_path, monkeypatch):
    run = RunDir(tmp_path, config={})
    run.log({"step": 1, "loss": 2.0})
    real = os.write

    def half(fd, data):  # a full disk: the kernel takes part of the record
        return real(fd, data[: len(data) // 2])

    monkeypatch.setattr(os, "write", half)
    # One line naming the file and how much of the record went down; the traceback in a log.
    with pytest.raises(WriteError, match=r"metrics\.jsonl failed: .*wrote 1[0-9] of 2[0-9] "
                                         r"bytes\) \(traceback in .*error\.log\)"):
        run.log({"step": 2, "loss": 1.0})
    assert (tmp_path / "error.log").read_text()
    monkeypatch.setattr(os, "write", real)
    run.log({"step": 3, "loss": 0.5})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}, {"step": 3, "loss": 0.5}]


def test_a_torn_last_line_from_a_crash_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n"
                    + '{"step": 3, "lo')
    assert truncate_metrics(path, 2) == 1
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


def test_memory_report_fields_are_the_ones_the_check_reads():
    names = {f.name for f in dataclasses.fields(MemoryReport)}
    assert {"arguments", "outputs", "temporaries", "aliased", "params", "opt_state"} <= names
