"""Context parallelism for the families beyond the Llama (tests/test_ring_attention.py has the
Llama's): Qwen2 (q/k/v biases), Mistral (a sliding window of 6, shorter than a chunk of 8 on
context=4, spanning two chunks of 4 on context=8) and Gemma 3 (local layers of window 12,
reaching two chunks back, a global layer, its norms, query scalar and a final logit soft cap),
each with and without LoRA (``_lora``: adapters on every projection, base and adapters both
trained, so the base's gradients are checked as well). One ``value_and_grad`` of the loss on a
packed, masked batch (4 segments per row, boundaries inside chunks and on their edges) on a
context mesh (the trunk in the load-balanced order, the attention as ring attention) gives the
loss and gradients of the same step on one device. The meshes (8 forced CPU devices):

- ``context=4``: Qwen2 (LoRA), Mistral, Gemma 3;
- ``context=8`` (chunks of 4 positions): Llama, Qwen2, Mistral and Gemma 3, each with LoRA;
- ``fsdp=2,context=4``: Qwen2 (LoRA), Mistral, Gemma 3 (LoRA);
- ``context=2,tensor=4`` (Megatron's split of the heads): Qwen2, Mistral (both with LoRA), Gemma 3.

The collective census of the same compilations shows the ring: collective-permutes of one
device's K/V chunks, and no all-gather over the context axis but the head's.

Tolerance, derived from the values: the ring sums in other orders than the one-device kernel
(each query's partial softmaxes merged chunk by chunk, ``dK, dV`` summed over the devices'
query chunks, the weight gradients over fsdp), so each gradient leaf may differ from the
reference by f32 roundings of that leaf's largest magnitude (units of ``2^-24`` times it), a
few per element, carried through the layers; the loss likewise in units of itself. Measured:
the worst leaf of every case is off by 11-55 such units (the most: Gemma 3's embedding with LoRA
on fsdp=2,context=4, its q-norm scale on context=8 52; Qwen2's embedding, Gemma 3's k-norm
scale about 30), the loss by 0-1.4.
``ULPS = 128`` (2^-17 of the scale: 7.6e-6, inside the 1e-5 relative tolerance of the other
sharded-training tests). What a real defect does, measured by
patching the ring: a pair's window one key too wide moves Mistral's and Gemma 3's gradients by
~8·10^6 units; the segments dropped from the off-diagonal pairs, every family's by
2-4·10^7 units.

The tiny Llama with LoRA on context=8 (the Llama without LoRA is test_ring_attention's): worst
leaf 20.9 units, the loss 1.4.

Slow: nineteen compilations (six one-device references, thirteen meshes), two at a time: 34 s
for seventeen on 2 quiet cores (123 s for sixteen on a 2-core host other test runs shared).
"""

from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effijax import lora
from effijax.models import gemma3_config, llama_config, mistral_config, qwen2_config
from effijax.paths import named_leaves
from effijax.sharding import batch_sharding, compile_with_census, make_mesh, param_shardings

S, B = 64, 2  # 2 x context = 8 chunks of 8 positions
ULPS = 128
EPS = 2.0 ** -24  # f32 rounding, relative

pytestmark = pytest.mark.slow  # nineteen compiles

_MISTRAL = mistral_config("mistral-tiny", seq_len=S, sliding_window=6)
_GEMMA3 = gemma3_config("gemma3-tiny", seq_len=S, sliding_window=12, final_logit_softcapping=30.0)
FAMILIES = {  # a name ending in _lora trains LoRA adapters with the base (_case)
    "llama_lora": llama_config("llama-tiny", seq_len=S),  # without LoRA: test_ring_attention
    "qwen2_lora": qwen2_config("qwen2-tiny", seq_len=S),
    "mistral": _MISTRAL,
    "gemma3": _GEMMA3,
    "mistral_lora": _MISTRAL,
    "gemma3_lora": _GEMMA3,
}
# Every family on context=4 alone (4 devices) and on context=8 (8 devices, chunks of 4: Mistral's
# window spans two of them, Gemma 3's three), and on composed meshes: fsdp=2 x context=4
# (parameters sharded, the batch split two ways) and context=2 x tensor=4 (Megatron's split of
# the heads, Gemma 3's q/k norms on split heads, the residual stream over (context, tensor)).
# The families' LoRA variants (base and adapters trained) stand for the plain ones where both
# would only repeat a mesh: their base gradients are compared too.
MESHES = {"context4": dict(fsdp=1, context=4, tensor=1),
          "context8": dict(fsdp=1, context=8, tensor=1),
          "fsdp2_context4": dict(fsdp=2, context=4, tensor=1),
          "context2_tensor4": dict(fsdp=1, context=2, tensor=4)}
CASES = [
    ("qwen2_lora", "context4"), ("mistral", "context4"), ("gemma3", "context4"),
    ("llama_lora", "context8"),
    ("qwen2_lora", "context8"), ("mistral_lora", "context8"), ("gemma3_lora", "context8"),
    ("qwen2_lora", "fsdp2_context4"), ("mistral", "fsdp2_context4"),
    ("gemma3_lora", "fsdp2_context4"),
    ("qwen2_lora", "context2_tensor4"), ("mistral_lora", "context2_tensor4"),
    ("gemma3", "context2_tensor4")]


def _moved(tree, seed, scale):
    """Every leaf moved by ``scale`` times a normal: biases and Gemma's norm scales start at 0,
    and a zero bias would be no test of where the bias goes."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys, strict=True)])


def _case(name, config):
    """``(step, params, batch)``: the loss and gradients of ``params`` (with LoRA: the base and
    the adapters, both trained)."""
    params = _moved(config.init_params(jax.random.key(0)), 1, 0.05)
    spec = None
    if name.endswith("_lora"):
        spec = lora.LoraSpec(rank=4, alpha=8.0, targets=config.lora_targets)
        adapters = _moved(lora.init(jax.random.key(2), params, spec), 3, 0.1)  # b nonzero
        params = {"base": params, "adapters": adapters}
    keys = jax.random.split(jax.random.key(4), 3)
    tokens = jax.random.randint(keys[0], (B, S + 1), 1, config.vocab_size)
    # Packed rows: 4 segments per row (non-decreasing ids), starting at 15, 30, 50 and 13, 32,
    # 48: inside chunks of 8 and on their edges. A fifth of the positions masked out.
    segments = jnp.sort(jax.random.randint(keys[1], (B, S), 1, 5), axis=1)
    mask = (jax.random.uniform(keys[2], (B, S)) < 0.8).astype(jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segments": segments,
             "mask": mask}
    loss_fn = config.loss_fn(spec)
    step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b)[0]))
    return step, params, batch


def _placed(config, params, batch, mesh):
    if mesh is None:
        return params, batch
    layout = config.tensor_layout()
    if isinstance(params, dict) and "adapters" in params:  # adapters replicated, base fsdp
        placed = {"base": jax.device_put(params["base"], param_shardings(
                      params["base"], mesh, "fsdp", tensor_layout=layout)),
                  "adapters": jax.device_put(params["adapters"], jax.sharding.NamedSharding(
                      mesh, jax.sharding.PartitionSpec()))}
    else:
        placed = jax.device_put(params, param_shardings(params, mesh, "fsdp",
                                                        tensor_layout=layout))
    return placed, jax.device_put(batch, batch_sharding(mesh))


@pytest.fixture(scope="module")
def runs():
    """Each family's step compiled once per mesh (None: one device; on a mesh with its
    collective census, from the same compilation), two at a time; then run. Per job:
    ``(census or None, loss, gradients on the host)``."""
    jobs = {}
    for name, config in FAMILIES.items():
        step, params, batch = _case(name, config)
        for mesh_name in ["one_device"] + [m for n, m in CASES if n == name]:
            axes = MESHES.get(mesh_name)
            mesh = None if axes is None else make_mesh(
                **axes, devices=jax.devices()[:int(np.prod(list(axes.values())))])
            jobs[name, mesh_name] = (step, mesh, *_placed(config, params, batch, mesh))

    def compile_(job):
        step, mesh, params, batch = job
        if mesh is None:
            return step.lower(params, batch).compile(), None
        with jax.set_mesh(mesh):
            return compile_with_census(step, params, batch)

    with ThreadPoolExecutor(max_workers=2) as pool:  # XLA compiles without the GIL
        compiled = dict(zip(jobs, pool.map(compile_, jobs.values()), strict=True))
    out = {}
    for key, (_, _, params, batch) in jobs.items():
        executable, census = compiled[key]
        loss, grads = executable(params, batch)
        out[key] = (census, float(loss), jax.device_get(grads))
    return out


@pytest.mark.parametrize(("name", "mesh_name"), CASES)
def test_a_context_mesh_gives_the_one_device_loss_and_gradients(runs, name, mesh_name):
    _, ref_loss, ref_grads = runs[name, "one_device"]
    _, loss, grads = runs[name, mesh_name]
    assert abs(loss - ref_loss) <= ULPS * EPS * abs(ref_loss), (loss, ref_loss)
    ref, got = dict(named_leaves(ref_grads)), dict(named_leaves(grads))
    assert ref.keys() == got.keys()
    worst = {}
    for path, want in ref.items():
        scale = float(np.abs(want).max())
        assert scale > 0, f"{path}: no gradient reaches it"  # every parameter is exercised
        worst[path] = float(np.abs(got[path] - want).max()) / (EPS * scale)
    assert max(worst.values()) <= ULPS, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    if name.endswith("_lora"):  # the adapters were trained, not just carried
        assert any(p.startswith("adapters/") for p in ref)
        assert any(p.startswith("base/") for p in ref)
    if name == "qwen2_lora":  # and Qwen2's biases
        assert any(p.endswith("k_proj/bias") for p in ref)


def _group_sizes(axes: dict, *, with_context: bool) -> set[int]:
    """The sizes of the device groups over the mesh's axes that (do not) include ``context``."""
    others = [size for axis, size in axes.items() if axis != "context"]
    sizes = {int(np.prod([s for s, keep in zip(others, pick, strict=True) if keep]))
             for pick in np.ndindex(*[2] * len(others))}
    return {size * axes["context"] for size in sizes} if with_context else sizes


@pytest.mark.parametrize(("name", "mesh_name"), CASES)
def test_the_census_shows_the_ring_and_no_gathered_keys_and_values(runs, name, mesh_name):
    # The attention moves keys and values by collective-permutes of one device's chunks (2 of
    # the 2 x context, its share of the batch, the kv heads), and nothing is all-gathered over
    # the context axis but the head's input and its gradient (the head and loss are whole on
    # each device, docs/sharding.md): two matmuls outside the layers. Weights (fsdp) and the
    # sequence-parallel stream (tensor) are gathered over the other axes. Without a tensor
    # axis the groups over the context axis and over the others differ in size, so a group's
    # size names its axes. (The all-gather variant fails here: K, V and ids gathered over it.)
    census, *_ = runs[name, mesh_name]
    axes, shape = MESHES[mesh_name], FAMILIES[name].shape()
    ring = [c for c in census.of("collective-permute") if c.op_name.endswith("ppermute")]
    (moved,) = {c.shape for c in ring if c.dtype == "f32"}  # keys, values, dK, dV alike
    # [M, B, N, C, K]: 2 chunks of S / (2 x context) positions; the kv heads all of them, or
    # XLA's split of them over the tensor axis (Gemma 3's 2 over tensor=4: 1 each).
    heads = shape.kv_heads if axes["tensor"] == 1 else moved[2]
    assert shape.kv_heads % heads == 0
    assert moved == (2, B // axes["fsdp"], heads, S // (2 * axes["context"]), shape.head_dim)
    if axes["tensor"] > 1:  # XLA splits Gemma 3's 2 kv heads over pairs of the 4 tensor
        return  # devices: groups of 2 that are not the context axis' (group sizes ambiguous)
    over_context = _group_sizes(axes, with_context=True)
    assert not over_context & _group_sizes(axes, with_context=False)
    gathered = [c for c in census.of("all-gather") if c.group_size in over_context]
    assert len(gathered) <= 2, str(census)
    assert all(c.op_name.endswith("dot_general") and "_run_layers" not in c.op_name
               for c in gathered), str(census)
