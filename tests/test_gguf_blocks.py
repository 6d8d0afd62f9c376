"""A GGUF file's quantized blocks kept as they are (``--frozen-dtype gguf``).

The decoders first: every block type decodes bit for bit as the ``gguf`` package's numpy
dequantization, a stack that mixes types decodes each layer with its own inside a scan, bad rows
are refused and the rows shard like their kernel. Then the model: a tiny Llama GGUF holding all
eight block types (two per role in places, as llama.cpp's Q4_K_M mixes them) loads with its
blocks kept, decodes to exactly the dequantized load, and a LoRA job on it trains with the
losses of the same job on the dequantized base (one device and FSDP over 8), then the command
line trains, generates and refuses a source that is not a GGUF.
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from effijax import lora
from effijax.errors import ConfigError
from effijax.models import llama_config
from effijax.precision import (
    GGML_BLOCKS,
    GGMLBlocks,
    dequantize,
    dequantize_blocks,
    dequantize_kernels,
    ggml_blocks,
    is_quantized,
    quantized_sharding,
)
from effijax.sharding import make_mesh

gguf = pytest.importorskip("gguf", reason="GGUF block layouts are checked against the gguf "
                           "package: pip install gguf")

# Where each type keeps its f16 scales (and minimums): the other bytes are any codes.
_F16_AT = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_rows(kind: str, f: int, d: int, rng, scale: float = 0.05) -> np.ndarray:
    """``f`` rows of valid ``kind`` blocks over ``d`` inputs: random codes, finite scales."""
    block, size = GGML_BLOCKS[kind]
    x = rng.integers(0, 256, size=(f, d // block, size), dtype=np.uint8)
    for at in _F16_AT[kind]:
        x[..., at:at + 2] = (scale * rng.standard_normal((f, d // block, 1))).astype(
            np.float16).view(np.uint8)
    return x.reshape(f, -1)


def reference(kind: str, rows: np.ndarray) -> np.ndarray:
    """The kernel ``[D, F]`` the gguf package decodes ``rows`` to."""
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind]).reshape(
        rows.shape[0], -1).T


@pytest.mark.parametrize("kind", list(GGML_BLOCKS))
def test_each_block_type_decodes_bit_for_bit_as_the_gguf_package(kind):
    rows = random_rows(kind, 3, 512, np.random.default_rng(0))
    want = reference(kind, rows)
    b = ggml_blocks([(kind, rows)], 512)
    assert b.shape == (1, 512, 3) and b.types == (kind,)
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize_blocks)(b))[0], want)
    got = jax.jit(dequantize, static_argnums=1)(jax.tree.map(lambda x: x[0], b),
                                                jnp.bfloat16)  # one layer, via the dispatch
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  want.astype(jnp.bfloat16).astype(np.float32))


def test_a_stack_of_mixed_types_decodes_each_layer_with_its_own_inside_a_scan():
    rng = np.random.default_rng(1)
    layers = [("Q4_K", random_rows("Q4_K", 4, 256, rng)), ("Q5_0", random_rows("Q5_0", 4, 256,
                                                                              rng)),
              ("Q6_K", random_rows("Q6_K", 4, 256, rng))]
    b = ggml_blocks(layers, 256)
    assert b.types == ("Q4_K", "Q5_0", "Q6_K") and b.kinds.tolist() == [0, 1, 2]
    assert b.rows.shape == (3, 4, 210)  # padded to Q6_K's row
    assert not b.rows[0, :, 144:].any() and not b.rows[1, :, 176:].any()
    _, scanned = jax.lax.scan(lambda c, blocks: (c, dequantize_blocks(blocks)), 0, b)
    for i, (kind, rows) in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(scanned[i]), reference(kind, rows))


@pytest.mark.parametrize(("layers", "match"), [
    ([("F16", np.zeros((2, 64), np.uint8))], "not a block type kept as it is"),
    ([("Q8_0", np.zeros((2, 30), np.uint8))], "Q8_0 rows of 32 inputs take 34 bytes"),
    ([("Q4_K", np.zeros((2, 144), np.uint8))], "Q4_K rows of 32 inputs take 0 bytes"),
])
def test_rows_that_do_not_fit_their_type_are_refused(layers, match):
    with pytest.raises(ConfigError, match=match):
        ggml_blocks(layers, 32, path="layers/mlp/up_proj/kernel")


def test_rows_shard_along_the_outputs_like_their_kernel():
    mesh = make_mesh()
    b = ggml_blocks([("Q8_0", np.zeros((16, 34), np.uint8))] * 2, 32)
    for spec in (P(None, "fsdp", None), P(None, None, "fsdp")):  # D split or F split
        sh = quantized_sharding(NamedSharding(mesh, spec), b)
        assert isinstance(sh, GGMLBlocks)
        assert (sh.rows.spec, sh.kinds.spec) == (P(None, "fsdp", None), P(None))
    odd = ggml_blocks([("Q8_0", np.zeros((12, 34), np.uint8))], 32)  # 12 rows over 8: whole
    assert quantized_sharding(NamedSharding(mesh, P(None, None, "fsdp")), odd).rows.spec == \
        P(None, None, None)


# ---------------------------------------------------------------------------------------------
# A tiny Llama GGUF with every block type

# GGUF tensor -> its type per layer; a name not listed (and ffn_down in layer 1) stays F32.
LAYOUT = {"attn_q": ("Q4_K", "Q5_0"), "attn_k": ("Q8_0", "Q8_0"), "attn_v": ("Q6_K", "Q8_0"),
          "attn_output": ("Q5_K", "Q5_K"), "ffn_gate": ("Q4_0", "Q4_1"),
          "ffn_up": ("Q5_1", "Q5_1"), "ffn_down": ("Q8_0", None)}
_K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # the gguf package does not quantize these: random blocks


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from _llama_files import VOCAB_SIZE, write_gguf

    config = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, d_model=256, d_ff=256,
                          head_dim=64, seq_len=16)
    params = config.init_params(jax.random.key(0))
    rng = np.random.default_rng(2)
    qtypes, raw = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0}, {}
    for role, kinds in LAYOUT.items():
        for i, kind in enumerate(kinds):
            name = f"blk.{i}.{role}.weight"
            if kind in _K_TYPES:
                out = {"attn_q": 256, "attn_v": 128, "attn_output": 256}[role]
                raw[name] = (gguf.GGMLQuantizationType[kind],
                             random_rows(kind, out, 256, rng, scale=2e-4))
            elif kind is not None:
                qtypes[name] = gguf.GGMLQuantizationType[kind]
    file = tmp_path_factory.mktemp("blocks") / "tiny.gguf"
    write_gguf(file, config, params, qtypes=qtypes, raw=raw)
    return file


@pytest.fixture(scope="module")
def loaded(tiny_file):
    from effijax.interop import load_gguf

    config, full = load_gguf(tiny_file)
    _, kept = load_gguf(tiny_file, keep_blocks=True)
    return config, full, kept


def test_loading_keeps_the_files_blocks_and_they_decode_to_the_dequantized_load(loaded,
                                                                                tiny_file):
    _, full, kept = loaded
    attn, mlp = kept["layers"]["attn"], kept["layers"]["mlp"]
    assert attn["q_proj"]["kernel"].types == ("Q4_K", "Q5_0")
    assert attn["v_proj"]["kernel"].types == ("Q6_K", "Q8_0")
    assert attn["o_proj"]["kernel"].types == ("Q5_K",)
    assert mlp["gate_proj"]["kernel"].types == ("Q4_0", "Q4_1")
    assert mlp["up_proj"]["kernel"].types == ("Q5_1",)
    assert not is_quantized(mlp["down_proj"]["kernel"])  # F32 in layer 1: dequantized
    assert not is_quantized(kept["embed"]["embedding"])  # embeddings stay floating
    # Bit for bit the dequantized load, the Q/K rows unpermuted as the loader does.
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 dequantize_kernels(kept), full)
    # The header alone gives the loaded base's exact bytes (effijax memory's count).
    from effijax.interop import gguf_kept_bytes
    from effijax.memory import tree_bytes

    assert tree_bytes(kept) == gguf_kept_bytes(tiny_file, dtype="fp32") < tree_bytes(full)


@pytest.fixture(scope="module")
def lora_runs(loaded):
    from effijax.recipe import batch_fn, init_frozen, init_state, plan_job

    config, full, kept = loaded
    spec = lora.LoraSpec(rank=4, targets=config.lora_targets)
    tokens = np.tile(np.arange(48, dtype=np.int32), 100)
    runs = {}
    for name, frozen, base, mesh, strategy in [("f32", None, full, None, "ddp"),
                                               ("gguf", "gguf", kept, None, "ddp"),
                                               ("gguf-fsdp", "gguf", kept, make_mesh(), "fsdp")]:
        job = plan_job(config, "fp32", optax.adam(1e-2), batch_size=8, lora=spec, mesh=mesh,
                       strategy=strategy, frozen_dtype=frozen,
                       kept_blocks=kept if frozen else None)
        frozen_base = init_frozen(job, base)
        state, batches, losses = init_state(job), batch_fn(job, tokens, frozen_base), []
        for i in range(4):
            state, metrics = job.step(state, batches(i))
            losses.append(float(metrics["lm_loss"]))
        runs[name] = (job, frozen_base, losses)
    return runs


def test_lora_on_the_kept_blocks_trains_as_on_the_dequantized_base(lora_runs):
    _, _, f32 = lora_runs["f32"]
    job, base, kept = lora_runs["gguf"]
    assert isinstance(base["layers"]["attn"]["q_proj"]["kernel"], GGMLBlocks)
    assert base["layers"]["attn"]["q_proj"]["kernel"].rows.dtype == jnp.uint8
    assert kept[-1] < kept[0]
    # The same weights, decoded in the step instead of at load: f32 rounding apart.
    np.testing.assert_allclose(kept, f32, rtol=2e-6)


def test_fsdp_on_8_devices_splits_the_rows_and_trains_as_one_device(lora_runs):
    _, base, losses = lora_runs["gguf-fsdp"]
    rows = base["layers"]["mlp"]["gate_proj"]["kernel"].rows
    assert rows.addressable_shards[0].data.size * 8 == rows.size  # split, not replicated
    np.testing.assert_allclose(losses, lora_runs["gguf"][2], rtol=2e-5)


def test_plan_job_without_the_blocks_says_how_to_load_them():
    from effijax.recipe import plan_job

    config = llama_config("llama-tiny", seq_len=16)
    with pytest.raises(ConfigError, match=r"keep_blocks=True\) and pass it as kept_blocks"):
        plan_job(config, "fp32", optax.sgd(0.1), batch_size=2, frozen_dtype="gguf",
                 lora=lora.LoraSpec(rank=2, targets=config.lora_targets))


def test_memory_counts_the_files_kept_blocks_exactly(tiny_file, capsys):
    from effijax.cli import build_parser
    from effijax.interop import gguf_kept_bytes

    def memory(*argv):
        args = build_parser().parse_args(["memory", *argv])
        return args.func(args)

    assert memory("--from", str(tiny_file), "--lora-rank", "4", "--frozen-dtype", "gguf",
                  "--precision", "fp32", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["frozen_bytes"] == gguf_kept_bytes(tiny_file, dtype="fp32")
    assert out["params_bytes"] == out["frozen_bytes"] + 4 * out["trainable_params"]
    for argv, said in [(("--params", "7B", "--lora-fraction", "0.01"), "instead of --params"),
                       (("--model", "llama-tiny", "--lora-rank", "2"), "(or a bundled GGUF")]:
        assert memory(*argv, "--frozen-dtype", "gguf") == 2
        err = capsys.readouterr().err
        assert ("--frozen-dtype='gguf': counts a GGUF file's own blocks: give the file with "
                "--from FILE.gguf") in err and said in err


def _effijax(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "effijax", *argv], cwd=cwd, text=True,
                          capture_output=True, timeout=600)


def test_a_source_that_is_not_a_gguf_is_refused_before_anything_loads(tmp_path, capsys):
    from effijax.cli import main

    assert main(["train", "--lora-rank", "4", "--lora-random-base", "--frozen-dtype", "gguf",
                 "--out", str(tmp_path / "run")]) == 2
    assert ("--frozen-dtype='gguf': keeps a GGUF file's quantized blocks, but --from (none) is "
            "not a .gguf file; give a GGUF model (e.g. --from smollm2), or use --frozen-dtype "
            "nf4 or int8") in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_then_generate_on_the_kept_blocks(tiny_file, tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("the thin cat sat on the mat. " * 200)
    out = tmp_path / "run"
    # fp32 named: the model is 256 wide, where auto is bf16 on a CPU with native bf16.
    result = _effijax("train", "--from", str(tiny_file), "--precision", "fp32", "--lora-rank",
                      "4", "--frozen-dtype", "gguf", "--data", str(data), "--steps", "3",
                      "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
                      "--no-progress", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("frozen base in float32/gguf Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 (kernels)"
            in result.stdout)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and np.isfinite(summary["eval_loss"])
    gen = _effijax("generate", "--from", str(out), "--prompt", "the thin", "--max-new-tokens",
                   "4", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.strip()
