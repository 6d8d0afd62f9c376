"""Weight files are written like every other output: readable by the group and others under the
usual umask (0644), not 0600 as safetensors' own ``save_file`` creates them."""

import os
import stat

import jax
import jax.numpy as jnp
import pytest

from effijax import lora
from effijax.interop import save_hf
from effijax.models import llama_config


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _modes(folder):
    return {p: stat.S_IMODE(os.stat(folder / p).st_mode) for p in os.listdir(folder)}


def test_adapter_files_are_0644(tmp_path, umask_022):
    params = {"blocks": {"attn": {"q": {"kernel": jnp.ones((2, 8, 8))}}}}
    spec = lora.LoraSpec(rank=2, targets=r"attn/q/kernel")
    adapters = lora.init(jax.random.key(0), params, spec)
    lora.save_adapters(tmp_path / "adapters.safetensors", adapters, spec)
    lora.export_peft(tmp_path / "peft", adapters, spec)
    assert _modes(tmp_path)["adapters.safetensors"] == 0o644
    assert _modes(tmp_path / "peft") == {"adapter_config.json": 0o644,
                                         "adapter_model.safetensors": 0o644}
    loaded, _ = lora.load_adapters(tmp_path / "adapters.safetensors")
    assert bool(jnp.all(loaded["blocks"]["attn"]["q"]["kernel"]["a"]
                        == adapters["blocks"]["attn"]["q"]["kernel"]["a"]))


def test_hugging_face_export_files_are_0644(tmp_path, umask_022):
    model = llama_config("llama-tiny", seq_len=16)
    params = model.init_params(jax.random.key(0))
    written = save_hf(tmp_path, model, params, max_shard_bytes=200_000)
    modes = _modes(tmp_path)
    assert any(name.endswith(".safetensors") for name in written)
    assert set(modes.values()) == {0o644}, modes
