"""Tensor parallelism on the 8 forced CPU devices: Megatron's layout over the ``tensor`` axis.

The tiny GPT and the tiny Llama (8 query heads so that ``tensor=8`` divides them; the Llama
with 4 key/value heads, split at ``tensor=4`` and replicated at ``tensor=8``) train 3 steps
under ``fsdp=2,tensor=4``, ``tensor=8`` and ``data=2,tensor=4`` with a different strategy
each, and give the single-device losses and parameters; the GPT's ``data=2,tensor=4`` run is
fp16 with dynamic loss scaling, the Llama's LoRA (each against its own single-device run).
Every tensor-parallel run is sequence-parallel (the default) but one GPT run without it, whose
census and temporaries are the comparison. Tolerance: test_sharded_training's (rtol 1e-5, atol
1e-6): a tensor split reorders the f32 reductions of the row-parallel matmuls and the vocabulary
sums. Every job compiles once (module fixture), at XLA's lowest backend optimisation level, but
for the three whose collectives and per-device memory are checked (compiled as a run compiles
them).
"""

import json
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
from _compiles import compiles
from _noise import assert_close_except_noise
from jax.sharding import PartitionSpec as P

from effijax import lora as lora_lib
from effijax.checkpoint import open_checkpoints, restore_target
from effijax.cli import build_parser, main
from effijax.data import load_corpus, split_corpus
from effijax.errors import ConfigError
from effijax.memory import activation_bytes, communication, estimate_tree, model_states, plan
from effijax.models import gpt_config, llama_config, preset, preset_names
from effijax.paths import named_leaves
from effijax.recipe import build_lm_job, plan_job
from effijax.sharding import activation_spec, make_mesh
from effijax.step import make_optimizer

GPT = gpt_config("tiny", seq_len=32, n_heads=8)  # D=64, F=256, V=256, 8 heads of 8
LLAMA = llama_config("llama-tiny", seq_len=32, n_heads=8, n_kv_heads=4)  # F=128, GQA 8/4
N_STEPS, BATCH, LR = 3, 8, 3e-3
RTOL, ATOL = 1e-5, 1e-6
FAST_COMPILE = {"xla_backend_optimization_level": 0}
# name: (model, mesh axes, strategy, precision, LoRA). fp16 (with dynamic loss scaling) and
# LoRA each ride on one of the three meshes, against their own single-device run.
RUNS = {
    "gpt": (GPT, None, "ddp", "fp32", False),
    "gpt fsdp=2,tensor=4": (GPT, {"fsdp": 2, "tensor": 4}, "fsdp", "fp32", False),
    "gpt fsdp=2,tensor=4 no-sp": (GPT, {"fsdp": 2, "tensor": 4}, "fsdp", "fp32", False),
    "gpt tensor=8": (GPT, {"tensor": 8}, "ddp", "fp32", False),
    "gpt fp16": (GPT, None, "ddp", "fp16", False),
    "gpt fp16 data=2,tensor=4": (GPT, {"data": 2, "tensor": 4}, "zero2", "fp16", False),
    "llama": (LLAMA, None, "ddp", "fp32", False),
    "llama fsdp=2,tensor=4": (LLAMA, {"fsdp": 2, "tensor": 4}, "zero1", "fp32", False),
    "llama tensor=8": (LLAMA, {"tensor": 8}, "fsdp", "fp32", False),
    "llama lora": (LLAMA, None, "ddp", "fp32", True),
    "llama lora data=2,tensor=4": (LLAMA, {"data": 2, "tensor": 4}, "fsdp", "fp32", True),
}
# Each tensor-parallel run and the single-device run it must reproduce.
PAIRS = [(name, name.split(" data")[0].split(" fsdp")[0].split(" tensor")[0])
         for name, (_, axes, *_) in RUNS.items() if axes is not None]
SP_RUN, TP_RUN, LLAMA_SP_RUN = "gpt fsdp=2,tensor=4", "gpt fsdp=2,tensor=4 no-sp", \
    "llama fsdp=2,tensor=4"
CENSUS_RUNS = (SP_RUN, TP_RUN, LLAMA_SP_RUN)  # compiled as a run compiles: census and memory


def _lora(model):
    return lora_lib.LoraSpec(rank=4, alpha=8.0, targets=model.lora_targets)


@pytest.fixture(scope="module")
def corpus():
    return split_corpus(load_corpus(max_bytes=200_000))


def _build(corpus, name):
    model, axes, strategy, precision, lora = RUNS[name]
    scale = "dynamic" if precision == "fp16" else None
    return build_lm_job(model, precision, make_optimizer(LR, 4, warmup_steps=1,
                                                         loss_scale=scale),
                        train_tokens=corpus[0], val_tokens=corpus[1], batch_size=BATCH,
                        mesh=None if axes is None else make_mesh(**axes), strategy=strategy,
                        num_eval_batches=0, lora=_lora(model) if lora else None,
                        sequence_parallel=not name.endswith("no-sp"))


def _compile(job, name):
    """``(executable, census, memory)``: as a run compiles it for the runs whose collectives
    and memory are checked, else at XLA's lowest backend optimisation (no census, no memory)."""
    if name in CENSUS_RUNS:
        done = job.compile()
        return done.step, done.census, done.memory
    return job.step.lower(job.state, job.batch(0)).compile(FAST_COMPILE), None, None


@pytest.fixture(scope="module")
def runs(corpus):
    jobs = {name: _build(corpus, name) for name in RUNS}
    # XLA compiles without the GIL: two at a time use both cores of a small CI machine.
    with ThreadPoolExecutor(max_workers=2) as pool:
        compiled = dict(zip(jobs, pool.map(_compile, jobs.values(), jobs), strict=True))
    out = {}
    for name, job in jobs.items():
        executable, census, memory = compiled[name]
        state, metrics = job.state, []
        for i in range(N_STEPS):
            with jax.set_mesh(job.mesh):
                state, m = executable(state, job.batch(i))
            metrics.append(jax.device_get(m))
        out[name] = {"job": job, "state": state, "metrics": metrics,
                     "census": census, "memory": memory}
    return out


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
@pytest.mark.parametrize("name, reference", PAIRS)
def test_tensor_parallel_run_matches_the_single_device_run(name, reference, runs):
    run, ref = runs[name], runs[reference]
    for i, (m, r) in enumerate(zip(run["metrics"], ref["metrics"], strict=True)):
        assert bool(m["skipped"]) == bool(r["skipped"]), i
        np.testing.assert_allclose(m["lm_loss"], r["lm_loss"], rtol=RTOL, err_msg=f"step {i}")
        if "loss_scale" in r:
            assert float(m["loss_scale"]) == float(r["loss_scale"]), i
    assert not bool(run["metrics"][-1]["skipped"])  # the last step trained
    if RUNS[name][3] == "fp16":
        # fp16 rounds each device's partial sums of a row-parallel matmul before the
        # all-reduce adds them: gradients differ at fp16's resolution (~1e-3 relative). Adam
        # normalises every element's step to about the learning rate, so an element whose
        # gradient is that small (a rare token's embedding row) can land anywhere within a
        # step: observed 3.9e-4 for one of 16,384, 1e-4 elsewhere. Bound: one step (the
        # losses above still agree to 1e-5). The noise leaf moves up to a step per step.
        atol, noise = LR, N_STEPS * LR
    else:
        atol, noise = ATOL, 1e-4
    assert_close_except_noise(run["state"].params, ref["state"].params, rtol=RTOL, atol=atol,
                              noise=noise)


def _specs(run, part="params"):
    return {path: leaf.sharding.spec for path, leaf in named_leaves(getattr(run["state"], part))}


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
def test_megatron_layout_composes_with_fsdp_and_every_strategy(runs):
    fsdp = _specs(runs["gpt fsdp=2,tensor=4"])  # fsdp: the other dimension over fsdp
    assert fsdp["blocks/attn/q/kernel"] == P(None, "fsdp", "tensor")  # column-parallel
    assert fsdp["blocks/attn/q/bias"] == P(None, "tensor")
    assert fsdp["blocks/attn/o/kernel"] == P(None, "tensor", "fsdp")  # row-parallel
    assert fsdp["blocks/attn/o/bias"] == P()
    assert fsdp["blocks/mlp/fc_in/kernel"] == P(None, "fsdp", "tensor")
    assert fsdp["blocks/mlp/fc_out/kernel"] == P(None, "tensor", "fsdp")
    assert fsdp["embed/embedding"] == P("tensor", "fsdp")  # vocabulary-parallel
    assert fsdp["blocks/ln1/scale"] == P()
    # ddp and zero2 keep the tensor split of parameters; zero2 shards the optimizer state too.
    assert _specs(runs["gpt tensor=8"])["blocks/mlp/fc_out/kernel"] == P(None, "tensor")
    zero2 = runs["gpt fp16 data=2,tensor=4"]["state"]
    assert zero2.params["blocks"]["attn"]["k"]["kernel"].sharding.spec == P(None, None, "tensor")
    mu = [leaf for path, leaf in named_leaves(zero2.opt_state)
          if path.endswith("mu/blocks/attn/k/kernel")]
    assert mu and all(leaf.sharding.spec == P(None, None, "tensor") for leaf in mu)  # fsdp=1
    # GQA: 4 key/value heads split over tensor=4, replicated over tensor=8 (queries split).
    llama4, llama8 = _specs(runs["llama fsdp=2,tensor=4"]), _specs(runs["llama tensor=8"])
    assert llama4["layers/attn/k_proj/kernel"] == P(None, None, "tensor")  # zero1: no fsdp
    assert llama8["layers/attn/k_proj/kernel"] == P()
    assert llama8["layers/attn/q_proj/kernel"] == P(None, None, "tensor")
    assert llama8["lm_head/kernel"] == P(None, "tensor")
    assert llama8["layers/mlp/down_proj/kernel"] == P(None, "tensor")


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
def test_lora_adapters_follow_their_kernels_split(runs):
    specs = _specs(runs["llama lora data=2,tensor=4"])  # fsdp=1: only the tensor split shows
    assert specs["layers/attn/q_proj/kernel/a"] == P(None, None, None)  # kernel (., ., tensor)
    assert specs["layers/attn/q_proj/kernel/b"] == P(None, None, "tensor")
    assert specs["layers/attn/o_proj/kernel/a"] == P(None, "tensor", None)  # (., tensor, .)
    assert specs["layers/attn/o_proj/kernel/b"] == P(None, None, None)
    assert specs["layers/mlp/down_proj/kernel/a"] == P(None, "tensor", None)
    assert specs["layers/mlp/up_proj/kernel/b"] == P(None, None, "tensor")


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
@pytest.mark.parametrize("name", [SP_RUN, TP_RUN])
def test_cross_entropy_never_gathers_the_logits(name, runs):
    run = runs[name]
    census, job = run["census"], run["job"]
    local_rows = BATCH // 2  # the batch splits over fsdp=2
    logits_bytes = local_rows * GPT.seq_len * GPT.vocab_size * 4
    gathers = census.of("all-gather")
    assert gathers, "fsdp=2 gathers weights"
    assert max(op.bytes for op in gathers) < logits_bytes / 2, [
        (op.shape, op.op_name) for op in gathers if op.bytes >= logits_bytes / 2]
    assert not any(GPT.vocab_size in op.shape and GPT.seq_len in op.shape for op in gathers)
    # Megatron's f/g: per layer two forward and two backward reductions (all-reduces; with
    # sequence parallelism reduce-scatters where XLA can, see test_sequence_parallel_census) of
    # the activations [rows * S, D] over the 4 tensor devices (scanned layers count once).
    acts = [op for op in census.of("all-reduce") + census.of("reduce-scatter")
            if op.shape == (local_rows * GPT.seq_len, GPT.d_model) and op.group_size == 4]
    assert len(acts) >= 4, acts
    assert job.mesh.shape["tensor"] == 4


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
@pytest.mark.parametrize("name", [SP_RUN, TP_RUN])
def test_per_device_bytes_agree_with_the_estimates(name, runs):
    run = runs[name]
    job, memory = run["job"], run["memory"]
    assert job.sequence_parallel == (name == SP_RUN)
    est = estimate_tree(GPT.abstract_params(), make_optimizer(LR, 4), param_dtype="f32",
                        compute_dtype="f32", zero_stage=3, devices=2, tensor=4,
                        tensor_layout=GPT.tensor_layout(), min_shard_size=1024)
    assert memory.params == est.params_bytes
    assert memory.opt_state == est.optimizer_bytes
    assert job.num_params * 4 / 8 < est.params_bytes < job.num_params * 4 / 4
    # Activations: Korthikanti's tensor-parallel formula (4 rows per device, f32, no dropout,
    # the vocabulary-parallel logits), sequence-parallel (34/t) or not (10 + 24/t), bounds the
    # step's temporaries as test_memory_measure's band does for one device (observed: 2.31x
    # with sequence parallelism, 2.26x without; fsdp=8: 2.61x, tensor=8: 2.47x).
    formula = activation_bytes(layers=GPT.n_layers, hidden=GPT.d_model, heads=GPT.n_heads,
                               seq_len=GPT.seq_len, batch_size=BATCH // 2, bytes_per_value=4,
                               dropout=False, vocab=GPT.vocab_size, tensor=4,
                               sequence_parallel=job.sequence_parallel)
    assert 1.0 <= memory.temporaries / formula <= 4.0, (memory.temporaries, formula)


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
def test_checkpoint_saved_under_one_mesh_restores_under_another(runs, tmp_path):
    source = runs["gpt fsdp=2,tensor=4"]
    saved = jax.device_get(source["state"])
    with open_checkpoints(tmp_path) as ckpt:
        ckpt.save(source["state"])
    for name in ("gpt tensor=8", "gpt"):
        target_job = runs[name]["job"]
        abstract = jax.eval_shape(lambda s=source["state"]: s)
        target = restore_target(abstract, target_job.shardings)
        with open_checkpoints(tmp_path) as ckpt:
            restored = ckpt.restore(target_state_abstract=target)
        for (path, leaf), (_, t) in zip(named_leaves(restored.params),
                                        named_leaves(target.params), strict=True):
            assert leaf.sharding == t.sharding, path
        for (path, a), (_, b) in zip(named_leaves(jax.device_get(restored.params)),
                                     named_leaves(saved.params), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.parametrize("model, axes, field", [
    (gpt_config("tiny", seq_len=16), {"tensor": 8}, "n_heads=4"),
    (llama_config("llama-tiny", seq_len=16, n_heads=8, n_kv_heads=4, d_ff=102),
     {"fsdp": 2, "tensor": 4}, "d_ff=102"),
    (gpt_config("tiny", seq_len=16, vocab_size=258), {"fsdp": 2, "tensor": 4},
     "vocab_size=258"),
])
def test_a_tensor_degree_that_does_not_divide_is_refused_before_compiling(model, axes, field):
    with pytest.raises(ConfigError, match=f"^{field}: .* tensor={axes['tensor']} does not "
                                          "divide"):
        plan_job(model, "fp32", make_optimizer(1e-3, 2), batch_size=BATCH,
                 mesh=make_mesh(**axes), strategy="fsdp")


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
def test_census_tensor_all_reduces_are_megatrons(runs):
    census = runs[TP_RUN]["census"]  # without sequence parallelism
    rows = BATCH // 2
    predicted = communication(1, layers=GPT.n_layers, hidden=GPT.d_model, seq_len=GPT.seq_len,
                              batch_size=rows, fsdp=2, tensor=4, zero_stage=3,
                              bytes_per_value=4)
    acts = [op for op in census.of("all-reduce")
            if op.bytes == predicted.tensor_bytes and op.group_size == 4]
    # Forward: the attention's and the MLP's row-parallel outputs, once each in the scanned
    # body. Backward: the MLP input's and q, k, v's input gradients, each reduced on its own.
    forward = [op for op in acts if "transpose" not in op.op_name and "_run_layers" in op.op_name]
    backward = [op for op in acts if "transpose" in op.op_name and "_run_layers" in op.op_name]
    assert len(forward) == 2, [op.op_name for op in acts]
    assert 2 <= len(backward) <= 4, [op.op_name for op in acts]


def _layer_ops(census, kinds, shape, *, backward):
    """The collectives of ``kinds`` of one ``shape`` over the 4 tensor devices in the scanned
    layers' forward (or backward) pass."""
    return [op for kind in kinds for op in census.of(kind)
            if op.shape == shape and op.group_size == 4 and "_run_layers" in op.op_name
            and ("transpose" in op.op_name) == backward]


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
@pytest.mark.parametrize("name", [SP_RUN, LLAMA_SP_RUN])
def test_sequence_parallel_census(name, runs):
    model, census = RUNS[name][0], runs[name]["census"]
    assert runs[name]["job"].sequence_parallel
    rows = BATCH // 2  # fsdp=2
    flat, whole = (rows * model.seq_len, model.d_model), (rows, model.seq_len, model.d_model)
    # Forward, once each in the scanned body: Megatron's g-bar (the attention's and the MLP's
    # row-parallel partial sums reduce-scattered along the sequence) and g (the sequence
    # gathered before q/k/v and the MLP's input); no all-reduce of an activation.
    assert len(_layer_ops(census, ["reduce-scatter"], flat, backward=False)) == 2
    assert len(_layer_ops(census, ["all-gather"], whole, backward=False)) == 2
    assert _layer_ops(census, ["all-reduce"], flat, backward=False) == []
    # Backward: where one column-parallel matmul's input gradient comes back (the GPT's fc_in)
    # XLA reduce-scatters it; where several are summed first (q, k, v; a gated MLP's gate and
    # up) it all-reduces each, as without sequence parallelism (the matmuls run on the flat
    # [B*S, D] tokens, where the sequence split has no form). One reduction per such input.
    back = _layer_ops(census, ["all-reduce", "reduce-scatter"], flat, backward=True)
    assert len(back) == (4 if name == SP_RUN else 5), [(op.kind, op.op_name) for op in back]


@pytest.mark.slow  # the runs fixture compiles 11 jobs (minutes on 2 cores)
def test_sequence_parallelism_lowers_the_temporaries_and_not_the_traffic(runs):
    sp, tp = runs[SP_RUN], runs[TP_RUN]
    # Observed 985,496 vs 1,406,608 bytes (0.70x); Korthikanti's formulas: 0.68x.
    assert sp["memory"].temporaries < 0.8 * tp["memory"].temporaries
    assert sp["memory"].params == tp["memory"].params

    def forward_wire(run):
        return sum(op.wire_bytes for op in run["census"].ops if op.group_size == 4
                   and "_run_layers" in op.op_name and "transpose" not in op.op_name)

    # The layers' forward: a reduce-scatter plus an all-gather move an all-reduce's bytes
    # (98,304 wire bytes per device either way). The backward gathers the sequence again for
    # the column-parallel weights' gradients (Megatron's too), so the step's total is higher.
    assert forward_wire(sp) == forward_wire(tp) > 0


def test_one_function_decides_the_activation_spec():
    mesh = {"data": 2, "fsdp": 1, "tensor": 4}
    batch = ("data", "fsdp")
    assert activation_spec((4, 32, 64), mesh, sequence_parallel=True) == P(batch, "tensor")
    assert activation_spec((4, 32, 64), mesh, sequence_parallel=False) == P(batch)
    assert activation_spec((4, 1, 64), mesh, sequence_parallel=True) == P(batch)  # a decode step
    assert activation_spec((4, 30, 64), mesh, sequence_parallel=True) == P(batch)
    assert activation_spec((4, 32), mesh, sequence_parallel=True) == P(batch)
    no_tensor = {"data": 2, "fsdp": 4, "tensor": 1}
    assert activation_spec((8, 32, 64), no_tensor, sequence_parallel=True) == P(batch)
    with pytest.raises(ValueError, match=r"\(3, 32, 64\) is not divisible by data\*fsdp = 2"):
        activation_spec((3, 32, 64), mesh, sequence_parallel=True)


def test_a_sequence_the_tensor_degree_does_not_divide_is_refused_for_training():
    model, opt = gpt_config("tiny", seq_len=30, n_heads=8), make_optimizer(1e-3, 2)
    mesh = make_mesh(fsdp=2, tensor=4)
    with pytest.raises(ConfigError, match=r"^seq_len=30: sequence parallelism splits each row "
                                          r"over the mesh's tensor=4, which does not divide "
                                          r"it; use a multiple of 4 \(e.g. 28 or 32\)"):
        plan_job(model, "fp32", opt, batch_size=BATCH, mesh=mesh, strategy="fsdp")
    job = plan_job(model, "fp32", opt, batch_size=BATCH, mesh=mesh, strategy="fsdp",
                   sequence_parallel=False)
    assert not job.sequence_parallel
    assert plan_job(gpt_config("tiny", seq_len=30), "fp32", opt, batch_size=BATCH,
                    mesh=make_mesh(fsdp=8), strategy="fsdp").sequence_parallel is False


@pytest.mark.slow  # four small compiles
def test_generation_and_ragged_sequences_keep_the_batch_only_layout():
    model = gpt_config("tiny", seq_len=32, n_heads=8)
    params = jax.jit(model.init_params)(jax.random.key(0))
    logits_fn, decode = jax.jit(model.logits_fn()), jax.jit(model.decode_fn())
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, model.vocab_size)
    want = logits_fn(params, tokens)
    cache = model.init_cache(8, 8)
    want_step, _ = decode(params, cache, tokens[:, :5], 0)
    with jax.set_mesh(make_mesh(fsdp=2, tensor=4)):
        # S=6: tensor=4 does not divide it, the model keeps the batch-only layout; S=8 splits.
        np.testing.assert_allclose(logits_fn(params, tokens), want, rtol=RTOL, atol=ATOL)
        wide = jax.numpy.concatenate([tokens, tokens[:, :2]], axis=1)
        np.testing.assert_allclose(logits_fn(params, wide)[:, :6], want, rtol=RTOL, atol=ATOL)
        # Generation: a ragged prompt (5 tokens) then a one-token step, batch-only.
        got_step, cache = decode(params, cache, tokens[:, :5], 0)
        np.testing.assert_allclose(got_step, want_step, rtol=RTOL, atol=ATOL)
        last, _ = decode(params, cache, tokens[:, 5:6], 5)
    np.testing.assert_allclose(last[:, 0], want[:, 5], rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------------
# Accounting (no compilation).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_activation_bytes_follow_korthikanti_with_tensor_and_sequence_parallelism(t):
    s, b, h, a, L = 2048, 2, 4096, 32, 4
    shape = dict(layers=L, hidden=h, heads=a, seq_len=s, batch_size=b)
    tp = activation_bytes(**shape, tensor=t)
    assert tp == L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    sp = activation_bytes(**shape, tensor=t, sequence_parallel=True)
    assert sp == L * s * b * h * (34 / t + 5 * a * s / (h * t))
    # The head fused with its loss: one chunk's vocabulary-parallel f32 logits (256 positions
    # of the 2 rows) and the final hidden states' gradient (p = 2 bytes, whole on each device).
    assert (activation_bytes(**shape, tensor=t, vocab=32000) - tp
            == 4 * 256 * b * 32000 // t + 2 * s * b * h)


def test_kv_heads_that_do_not_split_stay_whole_in_the_activation_count():
    shape = dict(layers=1, hidden=64, heads=8, seq_len=16, batch_size=1, bytes_per_value=2,
                 dropout=False, blockwise_attention=True, head_dim=8)
    split = activation_bytes(**shape, kv_heads=4, tensor=4)
    whole = activation_bytes(**shape, kv_heads=2, tensor=4)
    # K and V whole on every device (2 kv heads of 8: width 16 each) instead of a quarter of
    # 4 heads' (width 32 each); p·s·b = 2·16·1.
    psb = 2 * 16
    assert whole - split == psb * 2 * 16 - psb * 2 * 32 // 4
    with pytest.raises(ConfigError, match="^tensor=3: must divide heads=8"):
        activation_bytes(**shape, kv_heads=4, tensor=3)


def test_model_states_divide_by_the_tensor_degree_before_zero():
    full = model_states("7B", zero_stage=3, devices=2)
    tp = model_states("7B", zero_stage=3, devices=2, tensor=4)
    assert tp.model_state_bytes == full.model_state_bytes // 4
    assert tp.trainable_params == full.trainable_params == 7 * 10**9
    assert model_states("7B", tensor=8).params_bytes == 2 * 7 * 10**9 // 8


def test_communication_counts_megatron_and_zero_traffic():
    args = dict(layers=32, hidden=4096, seq_len=4096, batch_size=1)
    fsdp8 = communication(7 * 10**9, fsdp=8, zero_stage=3, **args)
    assert fsdp8.tensor_collectives == 0 and fsdp8.tensor_wire_bytes == 0
    assert fsdp8.grad_sync_wire_bytes == 3 * 7 / 8 * 2 * 7 * 10**9
    tp8 = communication(7 * 10**9, tensor=8, **args)
    assert tp8.grad_sync_wire_bytes == 0  # one data-parallel rank
    assert tp8.tensor_collectives == 4 * 32 and tp8.tensor_bytes == 2 * 4096 * 4096
    assert tp8.tensor_wire_bytes == 4 * 32 * 2 * 7 / 8 * tp8.tensor_bytes
    sp8 = communication(7 * 10**9, tensor=8, sequence_parallel=True, **args)
    assert sp8.tensor_collectives == 2 * tp8.tensor_collectives
    assert sp8.tensor_wire_bytes == tp8.tensor_wire_bytes
    remat = communication(7 * 10**9, tensor=8, checkpointing="block", **args)
    assert remat.tensor_collectives == 6 * 32


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "qwen2-tiny", "mistral-tiny"])
def test_every_family_declares_megatron_roles_for_all_its_kernels(name):
    model = preset(name) if name in preset_names() else None
    if model is None:
        pytest.skip(f"no preset {name}")
    layout = model.tensor_layout()
    names = dict(layout.dims)
    kernels = [path for path, _ in named_leaves(model.abstract_params())
               if path.endswith("/kernel") and not path.startswith("lm_head")]
    assert kernels and all(path in names for path in kernels), set(kernels) - set(names)
    assert names["embed/embedding"] == ("vocab", "embed")
    splits = [n for path in kernels for n in names[path] if n in ("heads", "kv", "mlp")]
    assert splits.count("mlp") >= 2 and splits.count("heads") == 2  # q, o
    assert not any("norm" in path or path.startswith("ln") for path in names)


def test_memory_command_takes_the_tensor_degree(capsys):
    shape = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "2048",
             "--batch-size", "1"]
    argv = ["memory", "--params", "7B", "--strategy", "fsdp", "--devices", "2", *shape, "--json"]
    args = build_parser().parse_args([*argv, "--tensor", "8", "--sequence-parallel"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_state_bytes"] == 16 * 7 * 10**9 // 8 // 2
    assert out["activation_bytes"] == 32 * 2048 * 4096 * (34 / 8 + 5 * 32 * 2048 / (4096 * 8))
    args = build_parser().parse_args([*argv, "--tensor", "3"])
    assert args.func(args) == 2
    assert "effijax memory: error: --tensor=3: must divide heads=32" in capsys.readouterr().err


@pytest.mark.slow  # the CLI's first train call loads JAX's compile paths and the corpus
def test_cli_train_refuses_a_tensor_degree_that_does_not_divide_before_compiling(tmp_path,
                                                                                   capsys):
    with compiles() as compiled:
        assert main(["train", "--strategy", "fsdp", "--mesh", "tensor=8", "--model", "tiny",
                     "--out", str(tmp_path / "run")]) == 2
    assert compiled == []
    err = capsys.readouterr().err
    assert "n_heads=4: tiny GPT: the mesh's tensor=8 does not divide n_heads=4" in err, err


def test_planner_counts_a_tensor_degree():
    alone = plan("30B", devices=8, device_memory="80GB", allow_lora=False)
    tp = plan("30B", devices=2, device_memory="80GB", tensor=4, allow_lora=False)
    assert alone.fits and alone.zero_stage == 3 and alone.tensor == 1  # 16/8 x 30e9 = 60 GB
    assert tp.fits and tp.zero_stage == 2 and tp.tensor == 4  # (2 + 14/2)/4 x 30e9 = 67.5 GB
    assert tp.states.model_state_bytes == 67_500_000_000
    assert "tensor 4" in tp.explain().splitlines()[-1]
    shape = dict(layers=32, hidden=4096, heads=32, seq_len=4096, global_batch=8, kv_heads=32,
                 ffn=11008, gated_mlp=True, vocab=32000, dropout=False)
    tp = plan("6.7B", devices=2, device_memory="80GB", tensor=4, **shape)
    layer_bytes = activation_bytes(layers=1, hidden=4096, heads=32, seq_len=4096,
                                   batch_size=tp.micro_batch, kv_heads=32, ffn=11008,
                                   gated_mlp=True, dropout=False, tensor=4)
    assert tp.fits and tp.activation_bytes >= layer_bytes
    with pytest.raises(ConfigError, match="^tensor=3: must divide heads=32"):
        plan("6.7B", devices=2, device_memory="80GB", tensor=3, **shape)


@pytest.mark.slow  # one effijax train run: a compile and two steps
def test_cli_run_shows_and_records_the_tensor_axis(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    out = tmp_path / "run"
    assert main(["train", "--strategy", "zero2", "--mesh", "fsdp=2,tensor=4", "--model", "tiny",
                 "--seq-len", "32", "--batch-size", "8", "--steps", "2", "--eval-batches", "0",
                 "--data", str(data), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "zero2 over 8 devices (mesh fsdp=2,tensor=4) sequence-parallel," in printed, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh"] == {"data": 1, "fsdp": 2, "tensor": 4}
    assert summary["sequence_parallel"] is True
    assert json.loads((out / "config.json").read_text())["mesh"] == summary["mesh"]
    rows = {(r["kind"], r["dtype"]): r for r in summary["collectives"]}
    assert rows[("all-reduce", "f32")]["count"] >= 4  # Megatron's activations, and more
    assert summary["steps"] == 2 and summary["final_loss"] > 0
