"""Context parallelism's memory: the compiled step against ``effijax memory``, and the planner.

The tiny GPT's train step (fp32, AdamW, one sequence of S = 1024 tokens, blockwise attention:
the model's ``auto`` on the CPU) is compiled on meshes with ``context`` = 1, 2 and 4 (one
device per position of the axis), and with two sequences on ``fsdp=2 x context=4``, and its
per-device memory read from
``compiled.memory_analysis()``, nothing allocated or run. ``effijax memory --context N`` (the
activation formula with a context degree, :func:`effijax.memory.activation_bytes`) is set
against it as ``tests/test_memory_measure.py`` sets the formula against a step: the measured
activations (temporaries minus gradients) within 1x to 4x of the formula, which counts what
the forward keeps and not the backward's transients.

What the formula says: every layer's activations split ``N`` ways along the sequence; the
fused head and loss run on the whole sequence after the trunk and stay whole (one chunk's f32
logits and the final hidden states' gradient, 786 KB here); model states are not split by
the axis (the arguments are the same on every mesh). Solving ``m(N) = split / N + whole`` from
the compiled ``N = 2`` and ``N = 4`` steps (both ring attention) gives the two parts as
measured; each is asserted within the same 1x to 4x of its formula. Observed (jax 0.10.2,
JAX_DISABLE_MOST_OPTIMIZATIONS=1): activations 17.67, 9.10, 5.43 MB for N = 1, 2, 4 against
the formula's 9.24, 5.01, 2.90 MB (1.91x, 1.82x, 1.87x); split part 14.7 MB against 8.45 MB
(1.74x), whole part 1.75 MB against 0.79 MB (2.2x). Ring attention inside a ``scan`` of layers
keeps nothing per ring step (its forward's loops are while loops: a static-length loop saved
the pair kernel's f32 initial values per step and chunk pair, ``m·s·b·H·K`` f32 each, in a
plain scan of two ring layers; this step, whose arrays those were too, held 23 KB less for it).

Two sequences per device: on ``context`` = 4 the step of two 512-token rows holds what the step
of one 1024-token row holds (observed 5.43 MB each), and XLA gathers nothing. The projections
take the activations as :func:`effijax.models._dense.token_rows` gives them: ``[B, S, D]`` on a
context mesh, where flattening them to ``[B·S, D]`` gathered the sequence (a flattened
``b·S + s`` index is no block of the devices' chunks once a device holds two rows: 11.57 MB and
eight all-gathers of whole-sequence activations per step before). The 3-D rows compute what the
flat rows compute, bit for bit, through every form of the parameter matmul.

The planner: ``effijax plan`` for a sequence that does not fit one device of the stated memory
(exit 1) fits with ``--context 4`` (exit 0), and ``--context search`` picks a context mesh
where no mesh without one fits.
"""

import json

import jax
import jax.numpy as jnp
import optax
import pytest

import effijax.models._layers as layers
from effijax.cli import main
from effijax.errors import ConfigError
from effijax.memory import activation_bytes, plan, plan_mesh
from effijax.models import context_attend, gpt_config
from effijax.models._dense import freeze_kernels
from effijax.precision import quantize
from effijax.recipe import compile_job, plan_job
from effijax.sharding import make_mesh

S = 1024
DEGREES = (1, 2, 4)
TINY = ["--model", "tiny", "--seq-len", str(S)]


@pytest.fixture(scope="module")
def compiled():
    """Per-device memory of the tiny GPT's train step on ``context`` = 1, 2, 4 (one sequence),
    and on ``fsdp=2 x context=4`` (two sequences, FSDP), keyed ``n`` and ``(2, 4)``."""
    model = gpt_config("tiny", seq_len=S)
    reports = {}
    for fsdp, n in [(1, n) for n in DEGREES] + [(2, 4)]:
        mesh = make_mesh(fsdp=fsdp, context=n, devices=jax.devices()[:fsdp * n])
        job = plan_job(model, "fp32", optax.adamw(1e-3), batch_size=fsdp, mesh=mesh,
                       strategy="fsdp" if fsdp > 1 else "ddp")
        with jax.set_mesh(mesh):
            reports[n if fsdp == 1 else (fsdp, n)] = compile_job(job, census=False).memory
    return reports


def _memory_json(capsys, *flags) -> dict:
    assert main(["memory", *TINY, "--precision", "fp32", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_effijax_memory_matches_the_compiled_step_on_each_context_degree(compiled, capsys):
    for n in DEGREES:
        out, m = _memory_json(capsys, "--context", str(n)), compiled[n]
        # Model states: not split by the context axis, and exactly what the step holds.
        assert (m.params, m.grads) == (out["params_bytes"], out["grads_bytes"])
        assert m.opt_state == out["optimizer_bytes"] + 4  # + AdamW's int32 count
        assert m.arguments == compiled[1].arguments
        measured = m.temporaries - m.grads
        assert 1.0 <= measured / out["activation_bytes"] <= 4.0, (n, measured, out)


def test_fsdp_splits_the_batch_and_context_the_sequence(compiled, capsys):
    # fsdp=2 x context=4, two sequences: each device holds a quarter of one sequence, as on
    # context=4 alone (observed 5.03 MB of activations against 5.43),
    # and an FSDP half of the model states.
    out, m = _memory_json(capsys, "--context", "4", "--strategy", "fsdp", "--devices", "2"), \
        compiled[2, 4]
    for measured, estimate in ((m.params, out["params_bytes"]), (m.grads, out["grads_bytes"]),
                               (m.opt_state, out["optimizer_bytes"])):
        assert abs(measured - estimate) <= 0.05 * estimate, (measured, estimate)
    measured = m.temporaries - m.grads
    assert 1.0 <= measured / out["activation_bytes"] <= 4.0, (measured, out)
    assert measured < compiled[2].temporaries - compiled[2].grads


def test_activations_fall_as_one_over_context_but_the_head(compiled, capsys):
    acts = {n: compiled[n].temporaries - compiled[n].grads for n in DEGREES}
    assert acts[4] < acts[2] < acts[1]
    shape = gpt_config("tiny", seq_len=S).shape().activation_args()
    formula = {n: activation_bytes(**shape, seq_len=S, batch_size=1, bytes_per_value=4,
                                   dropout=False, blockwise_attention=True, context=n)
               for n in DEGREES}
    assert formula == {n: _memory_json(capsys, "--context", str(n))["activation_bytes"]
                       for n in DEGREES}
    whole = formula[1] - activation_bytes(**{**shape, "vocab": None}, seq_len=S, batch_size=1,
                                          bytes_per_value=4, dropout=False,
                                          blockwise_attention=True)
    assert whole == 4 * 512 * 256 + 4 * S * 64  # one f32 logits chunk + the hidden gradient
    assert formula[4] - whole == -(-(formula[1] - whole) // 4)  # the layers: a quarter each
    # m(n) = split / n + whole, solved from the two ring-attention steps.
    split, kept = 4 * (acts[2] - acts[4]), 2 * acts[4] - acts[2]
    assert 1.0 <= split / (formula[1] - whole) <= 4.0, (split, formula[1] - whole)
    assert 1.0 <= kept / whole <= 4.0, (kept, whole)


@pytest.mark.slow  # one more compiled step (with its census): about 12 s on 2 loaded cores
def test_two_sequences_per_device_split_as_one_twice_as_long(compiled):
    # Two 512-token rows on context=4 (both on every device, each split in four): the
    # activations of one 1024-token row, within the formula's 1x to 4x, and no all-gather at
    # all (DDP gathers no weights): the ring's collective-permutes move K and V, nothing else
    # moves the sequence.
    model = gpt_config("tiny", seq_len=S // 2)
    mesh = make_mesh(context=4, devices=jax.devices()[:4])
    job = plan_job(model, "fp32", optax.adamw(1e-3), batch_size=2, mesh=mesh, strategy="ddp")
    with jax.set_mesh(mesh):
        step = compile_job(job)
    m, one = step.memory, compiled[4].temporaries - compiled[4].grads
    measured = m.temporaries - m.grads
    assert abs(measured - one) <= 0.05 * one, (measured, one)
    formula = activation_bytes(**model.shape().activation_args(), seq_len=S // 2, batch_size=2,
                               bytes_per_value=4, dropout=False, blockwise_attention=True,
                               context=4)
    assert 1.0 <= measured / formula <= 4.0, (measured, formula)
    assert step.census.count("all-gather") == 0, step.census.summary()
    assert step.census.count("collective-permute") > 0


def test_the_ring_inside_a_scan_keeps_nothing_per_step():
    # Ring attention differentiated inside a scan of layers: JAX splits its forward into the
    # part that depends on the layer's inputs and the part that does not, and a static-length
    # loop would save the latter per (step, chunk pair): the kernel's f32 initial values,
    # stacked (2.48 MB against the unrolled layers' 1.35 MB, before the forward's loops were
    # while loops). Now the scan holds what the unrolled layers hold, plus less than one such
    # stacked array (m·s·b·H·K f32 = 512 KB here; observed 1.65 MB).
    mesh = make_mesh(context=4, devices=jax.devices()[:4])
    s, h, k = 1024, 4, 16

    def layer(x, w):
        q = (x @ w).reshape(1, s, h, k)
        out = context_attend(q, q[:, :, :2], q[:, :, 2:], mesh=mesh)
        return x + out.reshape(1, s, h * k), None

    def scanned(w, x):
        return jnp.sum(jax.lax.scan(layer, x, w)[0])

    def unrolled(w, x):
        return jnp.sum(layer(layer(x, w[0])[0], w[1])[0])

    args = jax.ShapeDtypeStruct((2, h * k, h * k), jnp.float32), \
        jax.ShapeDtypeStruct((1, s, h * k), jnp.float32)
    temp = {f.__name__: jax.jit(jax.grad(f)).lower(*args).compile().memory_analysis()
            .temp_size_in_bytes for f in (scanned, unrolled)}
    stacked = 2 * s * 1 * h * k * 4  # m·s·b·H·K f32, m = 2 chunks per device
    assert temp["unrolled"] <= temp["scanned"] < temp["unrolled"] + stacked, temp


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_three_dimensional_token_rows_compute_the_flat_rows_bits(monkeypatch, dtype):
    # What a context mesh runs (token_rows keeps [B, S, D]) against the flat rows, through
    # each form of the parameter matmul: a trained kernel, a frozen one (held as bits on the
    # CPU), the tied head's transposed one and a QLoRA base's NF4 one, each with a LoRA
    # adapter and a bias; the values and every gradient equal to the bit.
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (2, 8, 64)).astype(dtype)
    w = (0.1 * jax.random.normal(keys[1], (64, 32))).astype(dtype)
    a = (0.1 * jax.random.normal(keys[2], (64, 4))).astype(dtype)
    b = (0.1 * jax.random.normal(keys[3], (4, 32))).astype(dtype)
    kernels = {"trained": lambda w: w, "frozen": lambda w: freeze_kernels({"kernel": w})["kernel"],
               "transposed": lambda w: w.T, "nf4": lambda w: quantize(w, "nf4")}

    def loss(form, x, w, a, b):
        y = layers._dense(x, kernels[form](w), jnp.ones(32, dtype),
                          layers._LoraHook(a, b, 2.0, 0.0, None),
                          transposed=form == "transposed").astype(jnp.float32)
        return jnp.sum(y * jnp.cos(y))

    for form in kernels:
        step = jax.value_and_grad(lambda *args, form=form: loss(form, *args), (0, 1, 2, 3))
        flat = jax.jit(step)(x, w, a, b)
        with monkeypatch.context() as patch:
            patch.setattr(layers, "token_rows", lambda x: x)
            rows = jax.jit(step)(x, w, a, b)
        for f, r in zip(jax.tree.leaves(flat), jax.tree.leaves(rows), strict=True):
            assert jnp.array_equal(f, r), form


@pytest.mark.parametrize(("tensor", "sequence_parallel"), [(1, False), (2, False), (2, True),
                                                          (4, True)])
def test_the_context_split_composes_with_the_tensor_split(tensor, sequence_parallel):
    # bf16 Llama-tiny shape (2 of 4 heads for keys and values: split by tensor 2, whole at 4):
    # at context 4 each layer keeps a quarter of what it keeps at context 1 on the same tensor
    # degree, plus the ring's f32 output (4·s·b·q over tensor x context); the head stays.
    shape = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128,
             "gated_mlp": True, "seq_len": S, "batch_size": 1, "dropout": False,
             "blockwise_attention": True, "tensor": tensor,
             "sequence_parallel": sequence_parallel}
    head = (activation_bytes(**shape, vocab=256) - activation_bytes(**shape))
    one = activation_bytes(**shape)
    four = activation_bytes(**shape, context=4)
    assert four == one // 4 + 2 * 4 * S * 64 // (4 * tensor)
    assert activation_bytes(**shape, vocab=256, context=4) - four == head


def test_memory_compile_prints_the_compiled_step_beside_the_formula(compiled, capsys):
    """``effijax memory --compile``: train's step compiled for the mesh the flags name (the
    formula's devices), XLA's bytes per device beside the formula's."""
    out = _memory_json(capsys, "--context", "4", "--compile")
    c, m = out["compiled"], compiled[4]
    assert (c["platform"], c["devices"]) == ("cpu", 4)
    assert c["mesh"] == {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
    # The model, mesh and batch the library compiles: the fixture's step under optax's
    # adamw, which train's optimizer extends by its schedule and clipping (bytes, not KB).
    assert abs(c["temporaries"] - m.temporaries) <= 1024, (c, str(m))
    assert abs(c["arguments"] - m.arguments) <= 64, (c, str(m))
    assert (c["params"], c["grads"]) == (out["params_bytes"], out["grads_bytes"])
    assert c["held"] == c["arguments"] + c["outputs"] - c["aliased"] + c["temporaries"]
    assert c["activation_bytes"] == c["temporaries"] - c["grads"]
    assert 1.0 <= c["activation_bytes"] / out["activation_bytes"] <= 4.0, (c, out)


def test_memory_compile_equals_what_train_reports(tmp_path, capsys):
    """The bytes `effijax train` records for its compiled step (``summary.json``'s memory: the
    pre-flight's numbers), byte for byte: its ``--mesh context=4`` on the 8 devices is
    ``fsdp=2 x context=4`` (FSDP, the axis named), ``--batch-size 2`` one row per FSDP rank."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    assert main(["train", "--model", "tiny", "--seq-len", "256", "--batch-size", "2", "--mesh",
                 "context=4", "--precision", "fp32", "--steps", "1", "--eval-batches", "0",
                 "--data", str(corpus), "--out", str(tmp_path / "run"), "--no-checkpoints",
                 "--no-progress"]) == 0
    trained = json.loads((tmp_path / "run" / "summary.json").read_text())["memory"]
    capsys.readouterr()
    assert main(["memory", "--model", "tiny", "--seq-len", "256", "--batch-size", "1",
                 "--strategy", "fsdp", "--devices", "2", "--context", "4", "--precision", "fp32",
                 "--compile", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["compiled"]
    assert c["mesh"] == {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    assert {k: c[k] for k in ("params", "opt_state", "arguments", "outputs", "aliased",
                              "temporaries", "grads")} == {
        k: trained[k] for k in ("params", "opt_state", "arguments", "outputs", "aliased",
                                "temporaries", "grads")}


def test_memory_compile_shards_a_lora_base_as_fsdp_does(capsys):
    assert main(["memory", "--model", "tiny", "--seq-len", "64", "--lora-rank", "4",
                 "--strategy", "fsdp", "--devices", "2", "--compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["compiled"]
    assert c["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    # The frozen bf16 base travels with the batch, split in two as the formula's FSDP splits
    # it (the whole base would be twice this), beside the batch's own few hundred bytes.
    beside_state = c["arguments"] - c["params"] - c["opt_state"] - c["other_state"]
    assert abs(beside_state - out["frozen_bytes"]) <= 0.02 * out["frozen_bytes"], (c, out)


def test_memory_compile_text_names_where_and_the_ratio():
    from effijax.cli._compiled_memory import CompiledBytes, compiled_text

    c = CompiledBytes(platform="cpu", devices=4, mesh={"data": 1, "fsdp": 1, "context": 4,
                                                       "tensor": 1},
                      params=728_064, opt_state=1_456_164, other_state=12, arguments=2_200_000,
                      outputs=2_184_240, aliased=2_184_228, temporaries=6_154_432,
                      grads=728_064, held=8_354_444)
    lines = compiled_text(c, 2_899_968, frozen="frozen base").splitlines()
    assert lines[0] == ("compiled: effijax train's step on 4 cpu devices "
                        "(data=1,fsdp=1,context=4,tensor=1), XLA's bytes per device")
    assert lines[3] == "  batch and frozen base     15.76 KB              15,760"
    assert lines[-1] == ("  activations (temporaries less grads) 5.43 MB: 1.87x the formula's "
                         "2.9 MB (cpu's buffers; another backend's differ)")


@pytest.mark.parametrize(("flags", "problem"), [
    (["--params", "7B"], "--compile=True: compiles a model's step: give --model PRESET or "
                         "--from SOURCE instead of --params"),
    ([*TINY, "--lora-fraction", "0.01"], "--compile=True: compiles real adapters: give LoRA as "
                                         "--lora-rank R instead of --lora-fraction"),
    ([*TINY, "--objective", "grpo", "--max-completion-length", "64"],
     "--compile=True: with --objective grpo the step trains the rows its rollout samples"),
    ([*TINY, "--devices", "16"], "--devices=16: --compile compiles for --devices x --context x "
                                 "--tensor = 16 device(s), and this process has 8 cpu device(s)"),
    ([*TINY, "--objective", "dpo", "--batch-size", "3"],
     "--batch-size=3: counts rows, and dpo trains pairs of rows (chosen, rejected)"),
])
def test_memory_compile_refuses_what_it_cannot_compile(capsys, flags, problem):
    assert main(["memory", *flags, "--compile"]) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith(f"effijax memory: error: {problem}")
    assert printed.out == ""  # refused before the formula's table, not after it
    # The CLI in a process that forced more CPU devices (this one: 8) leaves them as they are.
    assert jax.config.values["jax_num_cpu_devices"] == 8


def test_memory_refuses_what_a_context_axis_cannot_run(capsys):
    assert main(["memory", *TINY, "--seq-len", "1020", "--context", "4"]) == 2
    assert capsys.readouterr().err.startswith(
        "effijax memory: error: --seq-len=1020: context parallelism cuts each row into 2 x "
        "context = 8 equal chunks")
    with pytest.raises(ConfigError, match=r"^dropout=True: ring attention over the mesh's "
                                          r"context=2 has no attention dropout"):
        activation_bytes(layers=2, hidden=64, heads=4, seq_len=S, batch_size=1, context=2)
    with pytest.raises(ConfigError, match=r"^context=0: must be an integer >= 1"):
        activation_bytes(layers=2, hidden=64, heads=4, seq_len=S, batch_size=1, context=0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"context": 3}, r"^context=3: does not divide the 8 devices$"),
    ({"context": 4, "tensor": 4}, r"^context=4: tensor=4 x context=4 does not divide the 8 "
                                  r"devices$"),
    ({"context": 4, "seq_len": 4092}, r"^seq_len=4092: context parallelism cuts each row into "
                                      r"2 x context = 8 equal chunks"),
    ({"context": 2, "dropout": True}, r"^dropout=True: ring attention over the mesh's "
                                      r"context=2 has no attention dropout"),
])
def test_plan_mesh_refuses_a_context_degree_it_cannot_plan(kwargs, match):
    shape = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 4096, "global_batch": 8,
             "dropout": False}
    with pytest.raises(ConfigError, match=match):
        plan_mesh("200K", devices=8, device_memory="12MB", **{**shape, **kwargs})


def test_a_searched_context_degree_leaves_out_what_it_cannot_run():
    m = plan_mesh("200K", devices=8, device_memory="12MB", layers=2, hidden=64, heads=4,
                  seq_len=24, global_batch=8, tensor=1, context=None)
    assert [n.split(":")[0] for n in m.notes] == [
        "context=2 left out", "context=4 left out", "context=8 left out"]
    assert m.notes[0].startswith("context=2 left out: dropout=True: ring attention")
    assert m.notes[2].startswith("context=8 left out: seq_len=24: context parallelism cuts")
    assert {c.context for c in m.candidates} == {1}


def test_a_sequence_that_fits_no_device_fits_with_a_context_axis(capsys):
    plan_flags = [*TINY, "--device-memory", "6MB", "--global-batch", "1", "--no-lora"]
    assert main(["plan", *plan_flags, "--devices", "1"]) == 1
    alone = capsys.readouterr().out
    assert "-> mesh: nothing fits" in alone
    assert "activations do not fit even with checkpointing and micro-batch 1" in alone
    assert main(["plan", *plan_flags, "--devices", "4", "--context", "4"]) == 0
    split = capsys.readouterr().out
    assert "-> mesh: --mesh data=1,fsdp=1,context=4,tensor=1 --strategy ddp" in split
    assert ("context parallel: each sequence split over 4 devices of every rank (ring "
            "attention)") in split
    assert split.splitlines()[-1].startswith("-> plan: full fine-tuning, mixed precision, DDP, "
                                             "context 4, checkpointing=none")
    # The plan's activations are the formula's at the context degree, in bf16.
    shape = gpt_config("tiny", seq_len=S).shape()
    p = plan(shape.num_params, devices=1, context=4, device_memory="6MB", allow_lora=False,
             layers=2, hidden=64, heads=4, seq_len=S, global_batch=1, vocab=256,
             dropout=False, blockwise_attention=True)
    assert p.context == 4 and p.activation_bytes == activation_bytes(
        **shape.activation_args(), seq_len=S, batch_size=1, dropout=False, context=4)


def test_the_mesh_search_takes_a_context_axis_where_nothing_else_fits(capsys):
    argv = ["plan", "--model", "tiny", "--seq-len", "4096", "--devices", "4", "--tensor", "1",
            "--device-memory", "12MB", "--global-batch", "4", "--no-lora", "--json"]
    assert main([*argv, "--context", "1"]) == 1
    assert json.loads(capsys.readouterr().out)["mesh"] is None
    assert main([*argv, "--context", "search"]) == 0
    out = json.loads(capsys.readouterr().out)
    fitting = [c["mesh"] for c in out["candidates"] if c["fits"]]
    assert fitting == ["data=1,fsdp=2,context=2,tensor=1", "data=1,fsdp=1,context=4,tensor=1"]
    assert (out["mesh"], out["context"], out["strategy"]) == (fitting[0], 2, "zero1")
    # The ring's traffic: per layer and micro-batch, with block checkpointing, 2 forward hops
    # of the bf16 K and V shards (2048 positions x 64), 1 in the backward and 2 of their f32
    # gradients; 2 layers, 2 micro-batches. The context devices sync gradients as data
    # replicas: data=2 x context=2 all-reduce 2-byte gradients over 4, per micro-batch.
    m = plan_mesh("200K", devices=4, device_memory="12MB", layers=2, hidden=64, heads=4,
                  seq_len=4096, global_batch=4, tensor=1, context=2, dropout=False,
                  blockwise_attention=True, allow_lora=False)
    (ring,) = m.candidates
    p = ring.plan
    assert (ring.mesh, p.checkpointing, p.micro_batch, p.grad_accum_steps) == (
        "data=2,fsdp=1,context=2,tensor=1", "block", 1, 2)
    shard = 2048 * 64
    assert ring.context_wire_bytes == 2 * 2 * shard * (2 * 2 * 2 + 2 * 2 + 2 * 2 * 4)
    assert ring.communication == ring.context_wire_bytes + 2 * (2 * 3 / 4 * 200_000 * 2)
