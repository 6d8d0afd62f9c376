"""The sharded LM job: every strategy reproduces the single-device run, memory splits exactly,
the collectives are the strategy's, odd shapes train, and ``effijax train`` records it all.

All on the 8 CPU devices forced by conftest, with the tiny GPT (``seq_len=32``), batch 8 and a
dynamically loss-scaled AdamW. Step 0 overflows on purpose (an initial scale of 2^127 times a
loss multiplier of 4 makes the backward pass's seed cotangent 2^129 = inf in f32), so it is
skipped; the back-off factor 2^-100 brings the scale to 2^27 and the other steps train. Jobs
are built and compiled once per module (compilation dominates on small CPUs).
"""

import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import compiles
from _noise import assert_close_except_noise
from jax.sharding import PartitionSpec as P

from effijax import distributed
from effijax.cli import main
from effijax.data import load_corpus, split_corpus
from effijax.errors import ConfigError
from effijax.models import (
    abstract_params,
    abstract_split,
    gpt_config,
    init_params,
    make_loss_fn,
)
from effijax.paths import named_leaves
from effijax.precision import dynamic_loss_scale, get_policy, skipped_steps_of
from effijax.recipe import build_lm_job
from effijax.sharding import (
    batch_sharding,
    collective_census,
    make_mesh,
    partition_specs,
    state_shardings,
    with_shardings,
)
from effijax.step import init_train_state, make_optimizer, make_sharded_step

ROOT = pathlib.Path(__file__).resolve().parents[1]
N_STEPS = 4
BATCH = 8
TINY = gpt_config("tiny", seq_len=32)
# fp32 equivalence with the single-device run: sharding changes the order of the batch
# reductions (per-device partial sums, then a cross-device sum), so bits may differ; observed
# differences are ~1e-8 on parameters of size ~1e-2.
RTOL, ATOL = 1e-5, 1e-6
CONFIGS = {
    "ddp": ("ddp", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "fsdp": ("fsdp", {}),
    "hybrid-fsdp": ("fsdp", {"data": 2, "fsdp": 4}),
}
# Leaves the automatic rule leaves whole (fewer than 1024 elements): biases and LayerNorms.
REPLICATED = {f"blocks/attn/{m}/bias" for m in "qkvo"} | {
    "blocks/ln1/bias", "blocks/ln1/scale", "blocks/ln2/bias", "blocks/ln2/scale",
    "blocks/mlp/fc_in/bias", "blocks/mlp/fc_out/bias", "ln_f/bias", "ln_f/scale"}


def optimizer():
    scale = functools.partial(dynamic_loss_scale, init_scale=2.0**127, backoff_factor=2.0**-100)
    return make_optimizer(3e-3, N_STEPS, warmup_steps=1, weight_decay=0.1, loss_scale=scale)


@pytest.fixture(scope="module")
def corpus():
    return split_corpus(load_corpus(max_bytes=200_000))


def build(corpus, *, mesh=None, strategy="ddp", policy="fp32", model=TINY, **kwargs):
    train_tokens, val_tokens = corpus
    kwargs = {"loss_multiplier": 4.0, "num_eval_batches": 1, "seed": 0, **kwargs}
    return build_lm_job(model, policy, kwargs.pop("tx", None) or optimizer(),
                        train_tokens=train_tokens, val_tokens=val_tokens, batch_size=BATCH,
                        mesh=mesh, strategy=strategy, **kwargs)


def train(job, steps=N_STEPS, step=None):
    state, metrics = job.state, []
    for i in range(steps):
        state, m = (step or job.step)(state, job.batch(i))
        metrics.append(jax.device_get(m))
    return state, metrics


@pytest.fixture(scope="module")
def reference(corpus):
    job = build(corpus)
    state, metrics = train(job)
    return state, metrics, job.evaluate(state.params)


@pytest.fixture(scope="module")
def runs(corpus):
    jobs = {}
    for name, (strategy, mesh_kw) in CONFIGS.items():
        evaluates = strategy == "fsdp"  # each evaluation compiles once more: two suffice
        jobs[name] = build(corpus, mesh=make_mesh(**mesh_kw), strategy=strategy,
                           num_eval_batches=int(evaluates))
    # One compilation per job gives the executable, its memory and its census. XLA compiles
    # without the GIL: two at a time use both cores of a small CI machine.
    with ThreadPoolExecutor(max_workers=2) as pool:
        compiled = dict(zip(jobs, pool.map(lambda job: job.compile(), jobs.values()),
                            strict=True))
    out = {}
    for name, job in jobs.items():
        initial = {path: leaf.sharding for path, leaf in named_leaves(job.state)}
        state, metrics = train(job, step=compiled[name].step)
        out[name] = {"job": job, "state": state, "metrics": metrics,
                     "memory": compiled[name].memory, "census": compiled[name].census,
                     "initial": initial,
                     "eval": job.evaluate(state.params) if CONFIGS[name][0] == "fsdp" else None}
    return out


def _assert_close_except_noise(actual, desired):
    assert_close_except_noise(actual, desired, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------------
# Equivalence with the single-device job.
# --------------------------------------------------------------------------------------------


def test_reference_skips_the_overflowing_first_step_and_then_learns(reference):
    state, metrics, _ = reference
    assert [bool(m["skipped"]) for m in metrics] == [True, False, False, False]
    assert float(metrics[1]["loss_scale"]) == 2.0**27
    assert int(skipped_steps_of(state.opt_state)) == 1
    assert metrics[-1]["lm_loss"] < metrics[1]["lm_loss"]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_strategy_matches_single_device_job(config, runs, reference):
    ref_state, ref_metrics, ref_eval = reference
    run = runs[config]
    for i, (m, r) in enumerate(zip(run["metrics"], ref_metrics, strict=True)):
        assert bool(m["skipped"]) == bool(r["skipped"]), i
        np.testing.assert_allclose(m["lm_loss"], r["lm_loss"], rtol=RTOL, err_msg=f"step {i}")
        np.testing.assert_allclose(m["accuracy"], r["accuracy"], rtol=RTOL)
        assert float(m["loss_scale"]) == float(r["loss_scale"])
    state = run["state"]
    assert int(state.step) == N_STEPS
    _assert_close_except_noise(state.params, ref_state.params)
    _assert_close_except_noise(state.opt_state, ref_state.opt_state)
    if run["eval"] is not None:
        np.testing.assert_allclose(run["eval"], ref_eval, rtol=RTOL)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_is_born_sharded_and_keeps_its_layout(config, runs):
    run = runs[config]
    strategy, mesh_kw = CONFIGS[config]
    fsdp = mesh_kw.get("fsdp", 8)
    shardings = dict(named_leaves(run["job"].shardings))
    for path, leaf in named_leaves(run["state"]):
        assert leaf.sharding.is_equivalent_to(shardings[path], leaf.ndim), path
        assert run["initial"][path].is_equivalent_to(shardings[path], leaf.ndim), path
    emb = run["state"].params["embed"]["embedding"]
    if strategy == "fsdp":
        assert emb.sharding.spec == P("fsdp")  # (256, 64): the largest divisible dimension
        assert emb.addressable_shards[0].data.shape == (256 // fsdp, 64)
    else:
        assert emb.sharding.is_fully_replicated


# --------------------------------------------------------------------------------------------
# Per-device bytes: total / N exactly for the sharded leaves, the leftovers counted whole.
# --------------------------------------------------------------------------------------------


def _param_bytes():
    """(total bytes, bytes of the leaves the auto rule replicates) of the tiny GPT, f32."""
    leaves = dict(named_leaves(abstract_params(TINY, "fp32")))
    assert {p for p, x in leaves.items() if x.size < 1024} == REPLICATED
    total = sum(x.size * 4 for x in leaves.values())
    return total, sum(leaves[p].size * 4 for p in REPLICATED)


@pytest.mark.parametrize(
    "config, shard_params, shard_grads, shard_opt",
    [("ddp", 1, 1, 1), ("zero1", 1, 1, 8), ("zero2", 1, 8, 8), ("fsdp", 8, 8, 8),
     ("hybrid-fsdp", 4, 4, 4)],
)
def test_per_device_bytes_are_total_over_n_plus_the_replicated_leaves(
        config, shard_params, shard_grads, shard_opt, runs):
    total, rep = _param_bytes()
    assert (total - rep) % 8 == 0  # every sharded leaf divides evenly: exact, no padding
    mem = runs[config]["memory"]

    def per_device(n):
        return (total - rep) // n + rep

    assert mem.params == per_device(shard_params)
    assert mem.grads == per_device(shard_grads)
    # Adam's mu and nu are parameter-shaped; the rest of the optimizer state is scalars
    # (Adam's count, the schedule's step, the loss scale's fields): replicated.
    scalars = sum(x.nbytes for x in jax.tree.leaves(runs["ddp"]["state"].opt_state)
                  if x.ndim == 0)
    assert mem.opt_state == 2 * per_device(shard_opt) + scalars
    if config == "fsdp":  # the brief's number: params + optimizer state of the sharded leaves
        sharded = (mem.params - rep) + (mem.opt_state - 2 * rep - scalars)
        assert sharded * 8 == 3 * (total - rep)


# --------------------------------------------------------------------------------------------
# Collectives.
# --------------------------------------------------------------------------------------------


def test_fsdp_bf16_gathers_weights_in_bf16():
    # Lowered from the abstract state: nothing is allocated, only the partitioned program read.
    mesh, policy, tx = make_mesh(), get_policy("bf16"), make_optimizer(3e-3, N_STEPS)
    graphdef, _ = abstract_split(TINY, policy)
    abstract = jax.eval_shape(
        lambda key: init_train_state(init_params(TINY, policy, key), tx, key), jax.random.key(0))
    shardings = state_shardings(abstract, mesh, "fsdp")
    step = make_sharded_step(make_loss_fn(graphdef), tx, policy, mesh=mesh, strategy="fsdp",
                             specs=partition_specs(abstract.params, mesh), shardings=shardings,
                             has_aux=True)
    batch = {k: jax.ShapeDtypeStruct((BATCH, TINY.seq_len), jnp.int32,
                                     sharding=batch_sharding(mesh)) for k in ("inputs", "targets")}
    census = collective_census(step, with_shardings(abstract, shardings), batch)
    forward = [c for c in census.of("all-gather") if "transpose(" not in c.op_name]
    # Every weight is gathered where the forward pass uses it, after the cast: in bf16. The
    # block weights once per scanned layer (the loop body counts once), then the token
    # embedding, gathered once for the lookup and the tied head (which reads it as stored:
    # effijax.models._dense.matmul(..., transposed=True)), and the position embedding.
    assert {c.dtype for c in forward} == {"bf16"}
    layer = 2 * (4 * 64 * 64 + 2 * 64 * 256)
    assert sum(c.bytes for c in forward) == layer + 2 * (256 * 64 + 32 * 64)
    # The backward pass gathers the block weights again, in bf16 too (the 16-bit backward's
    # dx = dy·Wᵀ is one bf16 dot on the CPU; see effijax.models._dense).
    backward = [c for c in census.of("all-gather") if "transpose(" in c.op_name]
    assert backward and {c.dtype for c in backward} == {"bf16"}
    # Gradients are reduce-scattered, never all-reduced whole: every all-reduce is small.
    assert census.count("reduce-scatter", min_bytes=16384) >= 6
    assert census.count("all-reduce", min_bytes=4096) == 0


def test_ddp_reduces_gradients_and_gathers_no_parameter(runs):
    census = runs["ddp"]["census"]
    assert census.count("all-gather") == 0 and census.count("reduce-scatter") == 0
    grads = census.of("all-reduce", min_bytes=1024)
    assert {c.dtype for c in grads} == {"f32"}
    # One f32 all-reduce per sharded-size gradient: each block weight once (scan body), the
    # token embedding twice (lookup and tied head), the position embedding.
    layer = 4 * (4 * 64 * 64 + 2 * 64 * 256)
    assert sum(c.bytes for c in grads if c.bytes >= 8192) == layer + 2 * 4 * 256 * 64 \
        + 4 * 32 * 64


# --------------------------------------------------------------------------------------------
# Uneven shapes.
# --------------------------------------------------------------------------------------------


def test_gpt2_vocabulary_trains_under_fsdp4(corpus):
    # 50257 = 29 * 1733 divides by no mesh size: the automatic rule shards the embedding along
    # d_model instead, so jit never sees an indivisible dimension.
    model = gpt_config("tiny", seq_len=32, vocab_size=50257, d_model=32)
    job = build(corpus, model=model, mesh=make_mesh(data=2, fsdp=4), strategy="fsdp",
                tx=make_optimizer(1e-2, 3, clip_norm=None), loss_multiplier=1.0,
                num_eval_batches=0)
    assert job.shardings.params["embed"]["embedding"].spec == P(None, "fsdp")
    assert job.state.params["embed"]["embedding"].addressable_shards[0].data.shape == (50257, 8)
    _, metrics = train(job, 3)
    losses = [float(m["lm_loss"]) for m in metrics]
    assert all(math.isfinite(x) for x in losses) and losses[0] > 10.0  # ln(50257) = 10.8
    assert losses[-1] < losses[0]


# --------------------------------------------------------------------------------------------
# effijax train.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    return str(path)


def test_cli_fsdp_run_records_memory_and_collectives(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(["train", "--strategy", "fsdp", "--mesh", "data=2,fsdp=4", "--model", "tiny",
                 "--seq-len", "32", "--batch-size", "8", "--steps", "2", "--eval-batches", "0",
                 "--precision", "bf16", "--data", text_file, "--out", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "fsdp over 8 devices (mesh data=2,fsdp=4)" in printed and "per device: params" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["strategy"] == "fsdp" and config["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    summary = json.loads((out / "summary.json").read_text())
    total, rep = _param_bytes()
    mem = summary["memory"]
    assert mem["params"] == mem["grads"] == (total - rep) // 4 + rep  # f32 master, fsdp=4
    assert mem["model_states"] == mem["params"] + mem["grads"] + mem["opt_state"]
    assert mem["temporaries"] > 0 and mem["arguments"] >= mem["params"] + mem["opt_state"]
    rows = {(r["kind"], r["dtype"]): r for r in summary["collectives"]}
    assert rows[("all-gather", "bf16")]["count"] >= 9
    assert rows[("reduce-scatter", "f32")]["bytes"] > 0
    for r in summary["collectives"]:
        assert set(r) == {"kind", "dtype", "count", "bytes", "wire_bytes"}
    assert summary["steps"] == 2 and summary["final_loss"] > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mesh", "data=3,fsdp=2"], "--mesh='data=3, fsdp=2, tensor=1': the axis sizes "
                                      "multiply to 6 but there are 8 devices"),
        (["--strategy", "ddp", "--batch-size", "6"], "--batch-size=6: must be divisible by "
                                                     "data*fsdp = 8"),
        (["--strategy", "zero4"], "--strategy='zero4': unknown strategy; accepted: ddp"),
        (["--mesh", "data=2,model=4"], "--mesh='data=2,model=4': unknown axis 'model'"),
        (["--mesh", "data=2,fsdp=4", "--batch-size", "12"], "--batch-size=12: must be "
                                                            "divisible by data*fsdp = 8"),
        (["--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"],
         "--process-id=2: must be in [0, num_processes=2)"),
        (["--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1"],
         "--coordinator='127.0.0.1': expected host:port"),
        (["--num-processes", "2", "--process-id", "1", "--coordinator", "127.0.0.1:1",
          "--batch-size", "5"],
         "--batch-size=5: must be divisible by num_processes=2"),
    ],
)
def test_bad_parallel_flags_exit_2_naming_the_flag_before_compiling(flags, message, capsys,
                                                                     tmp_path):
    with compiles() as compiled:
        assert main(["train", *flags, "--out", str(tmp_path / "run")]) == 2
    assert compiled == []
    err = capsys.readouterr().err
    assert message in err, err


def test_process_settings_from_the_environment_are_checked_before_connecting(monkeypatch):
    monkeypatch.setenv("EFFIJAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("EFFIJAX_PROCESS_ID", "5")
    monkeypatch.setenv("EFFIJAX_COORDINATOR", "127.0.0.1:1234")
    with pytest.raises(ConfigError, match=r"EFFIJAX_PROCESS_ID=5: must be in \[0, "
                                          r"num_processes=2\)"):
        distributed.initialize()
    monkeypatch.setenv("EFFIJAX_PROCESS_ID", "1")
    assert distributed.process_settings() == ("127.0.0.1:1234", 2, 1)
    monkeypatch.setenv("EFFIJAX_COORDINATOR", "127.0.0.1:99999")
    with pytest.raises(ConfigError, match=r"EFFIJAX_COORDINATOR='127.0.0.1:99999': port 99999"):
        distributed.process_settings()
    monkeypatch.delenv("EFFIJAX_COORDINATOR")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:80")  # jax's own variable
    assert distributed.process_settings().coordinator_address == "10.0.0.1:80"
    for name in ("EFFIJAX_NUM_PROCESSES", "EFFIJAX_PROCESS_ID"):
        monkeypatch.delenv(name)
    assert distributed.process_settings() == (None, 1, 0)  # one process: the address is not needed
    assert distributed.initialize() is False and distributed.is_main()


# --------------------------------------------------------------------------------------------
# The sharding experiment's smoke preset.
# --------------------------------------------------------------------------------------------


def _load_experiment(name):
    spec = importlib.util.spec_from_file_location(f"experiment_{name}",
                                                  ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_sharding_experiment_smoke(tmp_path):
    experiment = _load_experiment("sharding")
    cfg = dataclasses.replace(experiment.PRESETS["smoke"], out=str(tmp_path))
    results = experiment.main(cfg)
    rows = {(r["strategy"], r["devices"]): r for r in results["rows"]}
    assert set(rows) == {(s, n) for s in cfg.strategies for n in cfg.devices}
    for (strategy, n), r in rows.items():
        # Measured from the shardings == estimate_tree for the same dtypes, once the leaves the
        # automatic rule keeps whole (below min_shard_size) are added back.
        assert r["measured"] == r["estimate"] + r["leftover"], (strategy, n)
        if n == 1 or strategy == "ddp":
            assert r["measured"] == rows[("ddp", 1)]["measured"]
    one = rows[("fsdp", 1)]["measured"]
    assert rows[("fsdp", 8)]["measured"] < rows[("zero2", 8)]["measured"] \
        < rows[("zero1", 8)]["measured"] < one
    assert (tmp_path / "sharding.png").stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["rows"]
