"""Committed checkpoints of every format effijax has written restore bit for bit today.

tests/golden/make_golden.py wrote them (see its docstring); a change to the checkpoint layout,
the step record, the optimizer-state tree or the PRNG key handling that would strand existing
checkpoints fails here. An older format is migrated on read.
"""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from effijax.checkpoint import FORMAT_VERSION, OLDEST_FORMAT, read_checkpoint, restore_target

GOLDEN = Path(__file__).with_name("golden")
sys.path.insert(0, str(GOLDEN))
import make_golden  # noqa: E402


def _stored(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        out = {}
        for name in npz.files:
            value = npz[name]
            if name.endswith("#bf16bits"):
                name, value = name.removesuffix("#bf16bits"), value.view(jax.numpy.bfloat16)
            out[name] = value
    return out


def test_every_format_from_the_oldest_is_committed():
    assert sorted(p.name for p in GOLDEN.glob("format-*")) == [
        f"format-{v}" for v in range(OLDEST_FORMAT, FORMAT_VERSION + 1)]


@pytest.mark.parametrize("version", range(OLDEST_FORMAT, FORMAT_VERSION + 1))
@pytest.mark.parametrize("name", sorted(make_golden.STATES))
def test_golden_checkpoint_restores_bit_for_bit(name, version):
    directory = GOLDEN / f"format-{version}" / name
    abstract = jax.eval_shape(make_golden.STATES[name])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state, record = read_checkpoint(directory, target_state_abstract=restore_target(abstract,
                                                                                   device))
    expected = _stored(GOLDEN / f"format-{version}" / f"{name}.npz")
    got = make_golden.host_values(state)
    assert sorted(got) == sorted(expected)
    for path, value in expected.items():
        assert got[path].dtype == value.dtype and got[path].shape == value.shape, path
        np.testing.assert_array_equal(got[path].reshape(-1).view(np.uint8),
                                      value.reshape(-1).view(np.uint8),
                                      err_msg=path)
    assert jax.dtypes.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
    # Read as today's format: an older record is migrated (format 2 added state_bytes).
    assert record["format"] == FORMAT_VERSION
    assert record["state_bytes"] == sum(v.nbytes for v in expected.values())
    assert record["metadata"] == {"golden": name} and record["step"] == 1


def _edited_copy(tmp_path, edit):
    import json
    import shutil

    directory = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / f"format-{FORMAT_VERSION}" / "full", directory)
    meta = directory / "1" / "_CHECKPOINT_METADATA"
    content = json.loads(meta.read_text())
    edit(content["custom_metadata"]["effijax"])
    meta.write_text(json.dumps(content))
    abstract = jax.eval_shape(make_golden.full_state)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return directory, restore_target(abstract, device)


def test_a_newer_format_is_refused_naming_both_versions(tmp_path):
    from effijax.errors import ConfigError

    directory, target = _edited_copy(tmp_path, lambda r: r.update(format=FORMAT_VERSION + 1))
    with pytest.raises(ConfigError, match=rf"step 1 is in checkpoint format {FORMAT_VERSION + 1}"
                       rf", newer than this effijax reads \(format {FORMAT_VERSION}\)"):
        read_checkpoint(directory, target_state_abstract=target)


@pytest.mark.parametrize("field, value, problem", [
    ("prng_keys", [], "expected an object"),
    ("step", "1", "expected an integer"),
    ("format", 0, f"formats {OLDEST_FORMAT}..{FORMAT_VERSION} are readable"),
])
def test_a_malformed_step_record_names_the_file_and_field(tmp_path, field, value, problem):
    from effijax.checkpoint import CorruptCheckpoint

    directory, target = _edited_copy(tmp_path, lambda r: r.update({field: value}))
    with pytest.raises(CorruptCheckpoint) as info:
        read_checkpoint(directory, target_state_abstract=target)
    assert info.value.field == f"{directory / '1' / '_CHECKPOINT_METADATA'}:effijax.{field}"
    assert problem in info.value.problem
