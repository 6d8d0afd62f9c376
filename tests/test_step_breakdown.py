"""effijax.observe.step_breakdown: a profiled step's time by kind of work, and its matmuls' FLOPs
counted from the compiled HLO equal to the model's own count.

A real trace of effijax's training step (the tiny GPT and the tiny Llama, each on one CPU
device, and a sharded reduction on eight) against the FLOPs written out from each config; the
HLO reading (a GEMM custom call, asynchronous collectives, a while loop's enclosing op, a
fusion that only moves data, the parents of XLA's stack frames) and the choice of a GPU's
kernels over the host's launches on hand-written texts and traces, since CI has no GPU.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from effijax.models import gpt_config, llama_config
from effijax.observe import CATEGORIES, hlo_ops, step_breakdown
from effijax.step import init_train_state, make_train_step

B = 2  # rows a step


def _profiled(compiled, args, tmp_path, steps=2):
    jax.block_until_ready(compiled(*args))
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(compiled(*args))
    (path,) = glob.glob(f"{tmp_path}/**/*.trace.json.gz", recursive=True)
    return step_breakdown(path, compiled.as_text(), steps=steps)


def _train_step(config):
    params = config.init_params(jax.random.key(0), "fp32")
    tx = optax.adamw(1e-3)
    state = init_train_state(params, tx, 0)
    s = config.seq_len
    batch = {"inputs": jnp.zeros((B, s), jnp.int32), "targets": jnp.ones((B, s), jnp.int32),
             "mask": jnp.ones((B, s), jnp.int32)}
    step = jax.jit(make_train_step(config.loss_fn(), tx, "fp32", has_aux=True))
    return step.lower(state, batch).compile(), (state, batch)


def _forward_flops(config) -> dict[str, int]:
    """One forward pass's matmul FLOPs (2 * M * N * K each), by category."""
    t, s, d, v, L = B * config.seq_len, config.seq_len, config.d_model, config.vocab_size, \
        config.n_layers
    if config.family == "gpt":
        h = k = None
        qkvo = 4 * d * d
        mlp = 2 * d * config.d_ff
        width = d
    else:
        h, k = config.n_heads, config.head_dim
        g = config.n_kv_heads or h
        qkvo = d * h * k + 2 * d * g * k + h * k * d
        mlp = 3 * d * config.d_ff
        width = h * k
    return {"matmuls": 2 * t * (qkvo + mlp) * L,
            "attention": 2 * 2 * B * s * s * width * L,  # q k^T and p v, every position
            "head and loss": 2 * t * d * v}


@pytest.mark.slow  # a profiled training step each: 1.5-1.7 s on 2 cores
@pytest.mark.parametrize("config", [
    dataclasses.replace(gpt_config("tiny", seq_len=16, n_layers=2), attention="naive"),
    dataclasses.replace(llama_config("llama-tiny", seq_len=16), attention="naive"),
], ids=["gpt", "llama"])
def test_a_training_steps_matmul_flops_are_the_models_by_category(config, tmp_path):
    compiled, args = _train_step(config)
    got = _profiled(compiled, args, tmp_path)
    # Forward once, backward twice (the input's and the weights' gradients) for every matmul;
    # the embedding's lookup is no matmul.
    for category, flops in _forward_flops(config).items():
        assert got.row(category).flops == 3 * flops, category
    ran = [r.category for r in got.rows]
    assert ran == [c for c in CATEGORIES if c in ran] and ran[-1] == "idle"
    assert {"matmuls", "attention", "norms and elementwise", "head and loss",
            "optimizer update"} <= set(ran)
    update = got.row("optimizer update")  # AdamW: elementwise, every parameter
    assert update.ops > 0 and update.seconds > 0 and update.flops == 0
    assert got.row("collectives").ops == 0  # one device
    assert got.row("unattributed").ops == 0  # the text names every op the trace timed
    assert 0 < got.busy_s <= got.step_s
    assert got.row("idle").seconds == pytest.approx(got.step_s - got.busy_s)
    table = got.markdown(peak_flops=1e12)
    assert table.splitlines()[0] == ("| category | ms per step | share of step | TFLOP/s | "
                                     "of peak |")
    assert len(table.splitlines()) == 2 + len(got.rows)


def test_a_sharded_programs_collectives_are_timed_per_device(tmp_path):
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((8, 64, 64)), NamedSharding(mesh, PartitionSpec("data")))
    total = jax.jit(lambda x: jnp.matmul(x, x).sum(0),
                    out_shardings=NamedSharding(mesh, PartitionSpec()))
    compiled = total.lower(x).compile()
    got = _profiled(compiled, (x,), tmp_path)
    assert got.row("collectives").ops >= 1  # the partial sums' all-reduce, on each device
    assert got.row("matmuls").flops == 2 * 64 * 64 * 64  # each device's one row of the batch
    np.testing.assert_allclose(np.asarray(compiled(x)), 8 * 64 * np.ones((64, 64)))


# --------------------------------------------------------------------------------------------
# The HLO text and the trace, as a GPU writes them.

_GPU_HLO = "\n".join([
    'HloModule jit_step, is_scheduled=true',
    '',
    '%fused_slice (param_0: f32[8,16], param_1: f32[1,16], param_2: s32[]) -> f32[8,16] {',
    '  %param_0 = f32[8,16]{1,0} parameter(0)',
    '  %param_1 = f32[1,16]{1,0} parameter(1)',
    '  %param_2 = s32[] parameter(2)',
    '  %c = s32[] constant(0)',
    '  ROOT %dus = f32[8,16]{1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %c)',
    '}',
    '',
    '%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {',
    '  %p = (s32[], f32[8,16]{1,0}) parameter(0)',
    '  %i = s32[] get-tuple-element(%p), index=0',
    '  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1',
    '  %w = f32[16,16]{1,0} constant({...})',
    '  %gemm = (f32[8,16]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_targ'
    'et="__cublas$lt$matmul", metadata={op_name="jit(step)/jvp()/while/body/dot_gener'
    'al" stack_frame_id=3}, backend_config={"gemm_backend_config":{"dot_dimension_num'
    'bers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lh'
    's_batch_dimensions":[],"rhs_batch_dimensions":[]}}}',
    '  %y = f32[8,16]{1,0} get-tuple-element(%gemm), index=0',
    '  %row = f32[1,16]{1,0} slice(%y), slice={[0:1], [0:16]}',
    '  %dus_fusion = f32[8,16]{1,0} fusion(%y, %row, %i), kind=kLoop, calls=%fused_sl'
    'ice, metadata={op_name="jit(step)/jvp()/while/body/dynamic_update_slice" stack_f'
    'rame_id=3}',
    '  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %dus_fusion)',
    '}',
    '',
    '%cond (p: (s32[], f32[8,16])) -> pred[] {',
    '  %p = (s32[], f32[8,16]{1,0}) parameter(0)',
    '  %i = s32[] get-tuple-element(%p), index=0',
    '  %n = s32[] constant(4)',
    '  ROOT %lt = pred[] compare(%i, %n), direction=LT',
    '}',
    '',
    '%add (a: f32[], b: f32[]) -> f32[] {',
    '  %a = f32[] parameter(0)',
    '  %b = f32[] parameter(1)',
    '  ROOT %s = f32[] add(%a, %b)',
    '}',
    '',
    'ENTRY %main (x: f32[8,16]) -> f32[8,16] {',
    '  %x = f32[8,16]{1,0} parameter(0)',
    '  %zero = s32[] constant(0)',
    '  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x)',
    '  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, met'
    'adata={op_name="jit(step)/while" stack_frame_id=1}',
    '  %h = f32[8,16]{1,0} get-tuple-element(%loop), index=1',
    '  %ars = f32[8,16]{1,0} all-reduce-start(%h), replica_groups={}, to_apply=%add',
    '  %ard = f32[8,16]{1,0} all-reduce-done(%ars)',
    '  %fmha = (f32[8,16]{1,0}, u8[0]{0}) custom-call(%ard, %ard, %ard), custom_call_'
    'target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/attention/fmha" stack'
    '_frame_id=2}',
    '  %o = f32[8,16]{1,0} get-tuple-element(%fmha), index=0',
    '  ROOT %upd = f32[8,16]{1,0} multiply(%o, %o), metadata={op_name="jit(step)/mul"'
    ' stack_frame_id=4}',
    '}',
    '',
    'FileNames',
    '1 "/site/effijax/step.py"',
    '2 "/site/effijax/models/_decoder.py"',
    '3 "/site/effijax/models/_dense.py"',
    '',
    'FunctionNames',
    '1 "make_train_step.<locals>.step"',
    '2 "Decoder.__call__"',
    '3 "matmul"',
    '',
    'FileLocations',
    '1 {file_name_id=1 function_name_id=1 line=260 end_line=260 column=1 end_column=2}',
    '2 {file_name_id=2 function_name_id=2 line=10 end_line=10 column=1 end_column=2}',
    '3 {file_name_id=3 function_name_id=3 line=20 end_line=20 column=1 end_column=2}',
    '',
    'StackFrames',
    '1 {file_location_id=1 parent_frame_id=1}',
    '2 {file_location_id=2 parent_frame_id=2}',
    '3 {file_location_id=3 parent_frame_id=3}',
    '4 {file_location_id=2 parent_frame_id=1}',
    '',
])


def test_the_hlo_text_gives_each_op_its_category_and_flops():
    ops = hlo_ops(_GPU_HLO)
    assert ops["gemm"].category == "matmuls"
    assert ops["gemm"].flops == 2 * 8 * 16 * 16  # (result, workspace): the result's shape
    assert ops["upd"].category == "norms and elementwise"  # the entry's last multiply
    assert ops["ars"].category == ops["ard"].category == "collectives"
    assert ops["loop"].category == "enclosing"  # its body's ops are timed, not it
    assert ops["row"].category == "copies and layout"
    assert ops["dus_fusion"].category == "copies and layout"  # a fusion that only moves data
    assert ops["fmha"].category == "attention" and ops["fmha"].flops is None  # by its scope
    # The fusion's own computation, the loop's condition and the scalar add are not ops a
    # trace times on their own; the condition's compare is (once an iteration).
    assert "dus" not in ops and "s" not in ops and ops["lt"].category == "norms and elementwise"


def test_xla_printers_parent_frames_are_read_one_lower():
    """XLA's text names a frame's parent one higher than its id (a root names itself): the
    dense kernel's frame 3 is read as called from frame 2, the decoder, then frame 1, the
    step; a frame called from the step is decided by its own file, not the step's."""
    from effijax.observe._breakdown import _frames, _parse

    _, _, tables = _parse(_GPU_HLO)
    chains = _frames(tables)
    assert [f for _, f in chains[3]] == ["matmul", "Decoder.__call__",
                                         "make_train_step.<locals>.step"]
    assert [f for _, f in chains[1]] == ["make_train_step.<locals>.step"]
    # An op of the step itself outside jvp/transpose is the update (the multiply, frame 4).
    text = _GPU_HLO.replace('op_name="jit(step)/mul" stack_frame_id=4',
                            'op_name="jit(step)/mul" stack_frame_id=1')
    assert hlo_ops(text)["upd"].category == "optimizer update"
    inside = text.replace('op_name="jit(step)/mul" stack_frame_id=1',
                          'op_name="jit(step)/transpose(jvp())/mul" stack_frame_id=1')
    assert hlo_ops(inside)["upd"].category == "norms and elementwise"


def _event(pid, op, ts, dur, module="jit_step"):
    return {"ph": "X", "pid": pid, "tid": 1, "name": op, "ts": ts, "dur": dur,
            "args": {"hlo_op": op, "hlo_module": module}}


def test_a_gpus_kernels_are_counted_not_the_hosts_launches(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    events = meta + [_event(1, "gemm", 0, 50), _event(1, "upd", 60, 50)]  # launches
    for step in range(2):  # two steps of 100 us; 4 iterations of the loop's gemm
        t0 = 1000 + 100 * step
        events += [_event(2, "gemm", t0 + 10 * i, 10) for i in range(4)]
        events += [_event(2, "ars", t0 + 40, 5), _event(2, "fmha", t0 + 50, 20),
                   _event(2, "upd", t0 + 80, 10), _event(2, "loop", t0, 40),
                   _event(2, "other", t0, 1, module="jit_other"),
                   _event(2, "command_buffer", t0 + 95, 3)]  # an op the text does not name
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    got = step_breakdown(path, _GPU_HLO, steps=2)
    assert got.row("matmuls").seconds == pytest.approx(40e-6)
    assert got.row("matmuls").ops == 4 and got.row("matmuls").flops == 4 * 2 * 8 * 16 * 16
    assert got.row("attention").seconds == pytest.approx(20e-6)
    assert got.row("attention").uncounted and "n/a" in got.markdown()
    assert got.row("collectives").seconds == pytest.approx(5e-6)
    assert got.row("unattributed").seconds == pytest.approx(3e-6)
    assert got.row("unattributed").uncounted and got.row("unattributed").ops == 1
    assert got.step_s == pytest.approx(198e-6 / 2)  # first op to last, over the two steps
    assert got.busy_s == pytest.approx(78e-6)
    assert got.row("idle").seconds == pytest.approx(got.step_s - 78e-6)
    assert step_breakdown(path, _GPU_HLO, steps=2, step_s=1e-3).row("idle").seconds == \
        pytest.approx(1e-3 - 78e-6)


def test_a_trace_without_the_programs_ops_is_refused(tmp_path):
    events = [_event(1, "gemm", 0, 10, module="jit_other")]
    with pytest.raises(ValueError, match="the trace holds no op of 'jit_step'"):
        step_breakdown({"traceEvents": events}, _GPU_HLO, steps=1)
    with pytest.raises(ValueError, match="steps=0: expected"):
        step_breakdown({"traceEvents": events}, _GPU_HLO, steps=0)
    with pytest.raises(ValueError, match="expected a compiled program's HLO text"):
        step_breakdown({"traceEvents": events}, "not hlo", steps=1)


def test_the_profiler_sums_a_compiled_steps_trace_and_says_when_it_cannot(tmp_path):
    from effijax.observe import Profiler

    a = jnp.ones((32, 32))
    compiled = jax.jit(lambda x: jnp.tanh(x @ x)).lower(a).compile()
    said = []
    prof = Profiler(tmp_path / "ok", 1, 2, report=said.append)
    step = prof.wrap(compiled)
    for _ in range(3):
        a = step(a)
    assert prof.breakdown.row("matmuls").flops == 2 * 32**3 and prof.breakdown.rows
    (folder,) = {p.parent for p in prof.trace_files()}
    assert (folder / "breakdown.md").read_text().startswith(
        "The compiled step's time by kind of work (steps 1-2, ")
    assert len(said) == 1 and said[0].startswith("the compiled step's time")
    resumed = Profiler(tmp_path / "resumed", 1, 3, start_step=1)  # steps 2 and 3 are left
    step = resumed.wrap(compiled)
    for _ in range(2):
        a = step(a)
    (folder,) = {p.parent for p in resumed.trace_files()}
    assert (folder / "breakdown.md").read_text().startswith(
        "The compiled step's time by kind of work (steps 2-3, ")

    class Elsewhere:  # a step whose text is another program's: the trace holds none of its ops
        def __call__(self, x):
            return compiled(x)

        def as_text(self):
            return jax.jit(jnp.sin).lower(a).compile().as_text()

    prof = Profiler(tmp_path / "other", 1, 1, report=said.append)
    prof.wrap(Elsewhere())(a)
    assert prof.breakdown is None
    (folder,) = {p.parent for p in prof.trace_files()}
    assert (folder / "breakdown.md").read_text().startswith(
        "The trace of step 1 could not be summed by kind of work: the trace holds no op of")
