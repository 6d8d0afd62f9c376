"""Unrolled layer loops (``unroll_layers`` / ``--unroll-layers``): the same loss and gradients
as the scan, for both families, with and without LoRA; a run may switch it on resume."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effijax import lora
from effijax.cli import main
from effijax.errors import ConfigError
from effijax.models import gpt_config, llama_config, model_from_dict
from effijax.paths import named_leaves

# Naive attention: the blockwise kernel has loops of its own (its tiles), whatever the layers do.
MODELS = {"llama": llama_config("llama-tiny", seq_len=16, attention="naive"),
          "gpt": gpt_config("tiny", seq_len=16, attention="naive")}


def _batch(model, b=2):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (b, model.seq_len + 1))
    return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
            "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
            "mask": jnp.asarray(rng.random((b, model.seq_len)) < 0.7, jnp.int32)}


# Gradients that are zero in exact arithmetic: adding the same key bias to every key adds
# q . b_k to a whole row of scores, which the softmax cancels. What a program computes there is
# the rounding residue of a sum that cancels (1e-11 here), which each program leaves in its own
# bits; it must stay at f32 rounding of the gradients it comes from.
ZERO_GRADIENTS = ("attn/k/bias",)


def _close(a, b):
    # The two programs fuse and sum in different orders: f32 rounding, relative to each
    # gradient's own scale (to the whole gradient's where it is zero in exact arithmetic).
    whole = max(float(np.max(np.abs(y))) for y in jax.tree.leaves(b))
    for (path, x), (_, y) in zip(named_leaves(a), named_leaves(b), strict=True):
        if path.endswith(ZERO_GRADIENTS):
            assert max(np.max(np.abs(x)), np.max(np.abs(y))) <= 1e-6 * whole, path
            continue
        scale = float(np.max(np.abs(y)))
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * scale, err_msg=path)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_unrolled_loss_and_gradients_equal_the_scan(family, adapted):
    model = MODELS[family]
    unrolled = dataclasses.replace(model, unroll_layers=True)
    params = model.init_params(jax.random.key(0))
    spec = lora.LoraSpec(rank=2, alpha=4.0, targets=model.lora_targets) if adapted else None
    if spec is not None:
        adapters = lora.init(jax.random.key(1), params, spec)
        # Random nonzero factors (b starts at zero), so that every adapter has a gradient.
        leaves, treedef = jax.tree.flatten(adapters)
        keys = jax.random.split(jax.random.key(2), len(leaves))
        adapters = jax.tree.unflatten(treedef, [
            x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys,
                                                                                strict=True)])
        params = {"base": params, "adapters": adapters}
    batch = _batch(model)

    def loss_and_grad(m):
        fn = m.loss_fn(spec)
        if spec is None:
            return jax.jit(jax.value_and_grad(lambda p: fn(p, batch)[0]))(params)
        return jax.jit(jax.value_and_grad(
            lambda a: fn({"base": params["base"], "adapters": a}, batch)[0]))(params["adapters"])

    (loss_s, grad_s), (loss_u, grad_u) = loss_and_grad(model), loss_and_grad(unrolled)
    np.testing.assert_allclose(loss_u, loss_s, rtol=1e-6)
    _close(grad_u, grad_s)
    # The unrolled program really is unrolled: no while loop left in it.
    fn = unrolled.loss_fn(spec)
    hlo = jax.jit(lambda p: fn(p, batch)[0]).lower(params).as_text()
    assert "while" not in hlo and "while" in jax.jit(
        lambda p: model.loss_fn(spec)(p, batch)[0]).lower(params).as_text()


def test_unroll_is_a_run_choice_not_architecture():
    model = MODELS["llama"]
    unrolled = dataclasses.replace(model, unroll_layers=True)
    assert unrolled.name == model.name and model_from_dict(unrolled.to_dict()) == unrolled
    assert dataclasses.replace(gpt_config("tiny"), unroll_layers=True).name == "tiny GPT"
    with pytest.raises(ConfigError, match="unroll_layers"):
        dataclasses.replace(model, unroll_layers="yes")
    with pytest.raises(ValueError, match="unroll_layers"):
        dataclasses.replace(MODELS["gpt"], unroll_layers=1)


def test_a_run_may_unroll_on_resume(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    out = tmp_path / "run"
    flags = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1",
             "--no-progress", "--data", str(corpus), "--out", str(out)]
    assert main(["train", "--steps", "2", *flags]) == 0
    # The resume unrolls (a changed program, the same run) and trains on to step 4.
    assert main(["train", "--steps", "4", "--allow-changes", "steps", "--unroll-layers",
                 *flags]) == 0
    record = json.loads((out / "config.json").read_text())
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert record["unroll_layers"] is False  # the original settings; the resume is listed
    assert record["resumes"][-1]["changed"]["unroll_layers"] == [False, True]
