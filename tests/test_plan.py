"""The planner's choices on fixed scenarios, and the arithmetic its explanation shows."""

import dataclasses

import pytest

from effijax.errors import ConfigError
from effijax.memory import (
    GB,
    Plan,
    _plan,
    activation_bytes,
    format_bytes,
    model_states,
    plan,
    plan_mesh,
)

LLAMA_7B = {"layers": 32, "hidden": 4096, "heads": 32}


def test_1b_on_one_80gb_gpu_is_plain_ddp():
    p = plan("1B", devices=1, device_memory="80GB")
    assert isinstance(p, Plan)
    assert (p.fits, p.zero_stage, p.lora, p.checkpointing) == (True, 0, False, "none")
    assert p.total_bytes == 16 * GB
    text = p.explain()
    assert "usable memory: 80 GB x (1 - 0.1 headroom) = 72 GB per device" in text
    assert "DDP: model states 16 B/param x 1e9 = 16 GB <= 72 GB usable" in text
    assert "ZeRO" not in text  # stopped at the first stage that fits


def test_7b_on_8x80gb_picks_zero1():
    p = plan("7B", devices=8, device_memory="80GB")
    assert (p.fits, p.zero_stage, p.lora) == (True, 1, False)
    assert p.states == model_states("7B", zero_stage=1, devices=8)
    assert p.total_bytes == int(38.5 * GB)
    text = p.explain()
    assert "DDP: model states 16 B/param x 7e9 = 112 GB > 72 GB usable" in text
    assert "ZeRO-1: model states (4 + 12/8) B/param x 7e9 = 38.5 GB <= 72 GB usable" in text
    assert p.explain().splitlines()[-1].startswith("-> plan: full fine-tuning, mixed precision")
    # The policies' name for the seeds' (2 + 2 + 12) mixed precision.
    assert p.precision == "bf16"
    assert "precision: bf16 (16-bit params and grads, f32 master and adamw state)" in text


def test_plan_counts_adafactor_at_its_bound_and_says_so():
    """adafactor's factored moments depend on the shapes the planner does not have: it counts
    one value per parameter (lion's count, never below adafactor's real state) and says so."""
    p = plan("7B", devices=8, device_memory="80GB", optimizer="adafactor")
    bound = plan("7B", devices=8, device_memory="80GB", optimizer="lion")
    assert (p.fits, p.zero_stage, p.total_bytes) == (bound.fits, bound.zero_stage,
                                                     bound.total_bytes)
    assert ("f32 master and adafactor state, at most 1 value per parameter: its factored "
            "second moments keep r + c per r x c matrix") in p.explain()


def test_70b_on_8x80gb_needs_lora_with_fsdp():
    # Seed 003: "Adam requires 140 GB per GPU, Adam + LoRA requires 18.9 GB per GPU" on 8 GPUs.
    p = plan("70B", devices=8, device_memory="80GB")
    assert (p.fits, p.lora, p.lora_fraction, p.zero_stage) == (True, True, 0.01, 3)
    assert p.states.model_state_bytes == int(18.9 * GB)
    text = p.explain()
    assert "full fine-tuning, ZeRO-1: model states (4 + 12/8) B/param x 70e9 = 385 GB" in text
    assert "ZeRO-2: model states (2 + 14/8) B/param x 70e9 = 262.5 GB > 72 GB usable" in text
    assert "ZeRO-3/FSDP: model states 16/8 B/param x 70e9 = 140 GB > 72 GB usable" in text
    assert "full fine-tuning: model states do not fit at any ZeRO stage" in text
    assert "(2 + 16 x 0.01)/8 B/param x 70e9 = 18.9 GB <= 72 GB usable" in text


def test_70b_without_lora_does_not_fit():
    p = plan("70B", devices=8, device_memory="80GB", allow_lora=False)
    assert not p.fits
    assert (p.zero_stage, p.states, p.total_bytes) == (None, None, None)
    text = p.explain()
    assert "LoRA" not in text.split("-> does not fit")[0]
    assert "at least 16 such devices" in text  # 1120 GB / 72 GB = 15.6
    assert "LoRA not tried (allow_lora=False)" in text


def test_405b_on_8x80gb_does_not_fit_even_with_lora():
    # Seed 003, table S3: LoRA + Adam on 8 GPUs needs 109.35 GB per GPU.
    p = plan("405B", devices=8, device_memory="80GB")
    assert not p.fits
    text = p.explain()
    assert "(2 + 16 x 0.01)/8 B/param x 405e9 = 109.35 GB > 72 GB usable" in text
    assert "-> does not fit" in text
    assert "at least 13 such devices" in text  # 874.8 GB / 72 GB = 12.15
    assert "at least 90 such devices" in text  # 6480 GB / 72 GB


def test_405b_on_32x80gb_fits_with_lora():
    p = plan("405B", devices=32, device_memory="80GB")
    assert (p.fits, p.lora, p.zero_stage) == (True, True, 3)
    assert p.states.model_state_bytes == int(27.3375 * GB)  # table S3, 32 GPUs


def test_7b_with_activations_needs_checkpointing():
    # 7B, s=2048, global batch 64 on 8 GPUs: 8 sequences per device. Without checkpointing the
    # activations are 32 x 7.65 GB = 244.8 GB; with it, 32 x 134 MB + 7.65 GB = 11.95 GB.
    p = plan("7B", devices=8, device_memory="80GB", **LLAMA_7B, seq_len=2048, global_batch=64)
    assert (p.fits, p.zero_stage, p.checkpointing) == (True, 1, "block")
    assert (p.micro_batch, p.grad_accum_steps) == (8, 1)
    acts = activation_bytes(**LLAMA_7B, seq_len=2048, batch_size=8, checkpointing="block")
    psbh = 2 * 2048 * 8 * 4096
    assert p.activation_bytes == acts == 32 * psbh + 57 * psbh  # inputs + one block (bracket 57)
    assert p.total_bytes == int(38.5 * GB) + acts
    text = p.explain()
    assert "batch: global 64 / 8 devices = 8 sequences per device" in text
    assert "activations 244.81 GB (32 layers x 7.65 GB, no checkpointing, micro-batch 8)" in text
    assert "ZeRO-3/FSDP: model states 16/8 B/param x 7e9 = 14 GB + activations 244.81 GB" in text
    assert "-> plan: full fine-tuning, mixed precision, ZeRO-1, checkpointing=block" in text


def test_long_sequences_need_smaller_micro_batches():
    # s=8192: with checkpointing one block of 8 sequences alone is 95 GB; 4 sequences fit next
    # to ZeRO-3's 14 GB (70.1 GB), with 2 accumulation steps to keep the global batch of 64.
    p = plan("7B", devices=8, device_memory="80GB", **LLAMA_7B, seq_len=8192, global_batch=64)
    assert (p.fits, p.zero_stage, p.checkpointing) == (True, 3, "block")
    assert (p.micro_batch, p.grad_accum_steps) == (4, 2)
    assert p.micro_batch * p.grad_accum_steps * p.devices == 64
    assert p.total_bytes <= p.usable_bytes
    assert "micro-batch 4 x 2 accumulation steps" in p.explain()


def test_activations_that_never_fit():
    p = plan("1B", devices=1, device_memory="16GB", **LLAMA_7B, seq_len=65536, global_batch=1)
    assert not p.fits
    assert "activations do not fit even with checkpointing and micro-batch 1" in p.explain()


def test_blockwise_attention_lets_long_sequences_fit():
    shape = {**LLAMA_7B, "seq_len": 8192, "global_batch": 64}
    p = plan("7B", devices=8, device_memory="80GB", blockwise_attention=True, **shape)
    assert (p.zero_stage, p.checkpointing, p.micro_batch) == (1, "block", 8)


def test_headroom():
    assert plan("7B", devices=1, device_memory="112GB", headroom=0).zero_stage == 0
    assert not plan("7B", devices=1, device_memory="112GB", allow_lora=False).fits
    assert plan("7B", devices=1, device_memory="112GB").usable_bytes == int(100.8 * GB)


def test_plan_is_immutable():
    p = plan("1B", devices=1, device_memory="80GB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.zero_stage = 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": 32}, r"hidden=None: required with layers: .*\(missing: hidden, heads, "
         r"seq_len, global_batch\)"),
        ({**LLAMA_7B, "seq_len": 2048, "global_batch": 12}, "global_batch=12: does not divide "
         "evenly over 8 devices; use a multiple of 8"),
        ({"headroom": 1.0}, r"headroom=1\.0: must be a fraction in \[0, 1\)"),
        ({"optimizer": "sgd_momentum"}, "optimizer='sgd_momentum': unknown optimizer; accepted: "
                                        "adamw, adam, lion, adafactor, sgd"),
        ({"devices": 0}, "devices=0: must be an integer >= 1"),
        ({"device_memory": "80 gigs"}, "device_memory='80 gigs': unknown unit 'gigs'"),
        ({"device_memory": "0GB"}, "device_memory='0GB': must be positive"),
        ({"lora_fraction": 2}, r"lora_fraction=2: must be a number in \(0, 1\]"),
    ],
)
def test_plan_validation(kwargs, match):
    args = {"devices": 8, "device_memory": "80GB", **kwargs}
    with pytest.raises(ConfigError, match=f"^{match}") as e:
        plan("7B", **args)
    assert e.value.field == match.split("=")[0]


# ---------------------------------------------------------------------------------------------
# The passes plan() runs, one at a time.
# ---------------------------------------------------------------------------------------------
NO_SHAPE = dict.fromkeys(("layers", "hidden", "heads", "seq_len", "global_batch"))
LAYER_DEFAULTS = {"dropout": True, "blockwise_attention": False, "kv_heads": None,
                  "head_dim": None, "ffn": None, "gated_mlp": False}


def _request(num_params="7B", *, shape=None, allow_lora=True, vocab=None, **kwargs):
    args = {"devices": 8, "device_memory": "80GB", "optimizer": "adam", "headroom": 0.1,
            "lora_fraction": 0.01, **kwargs}
    layer_options = {k: args.pop(k, v) for k, v in LAYER_DEFAULTS.items()}
    return _plan._check_request(num_params, allow_lora=allow_lora,
                                shape={**NO_SHAPE, **(shape or {})},
                                layer_options=layer_options, vocab=vocab, **args)


def test_check_request_converts_the_arguments():
    r = _request("70B")
    assert (r.num_params, r.devices, r.device_memory, r.usable) == (70 * 10**9, 8, 80 * GB,
                                                                     72 * GB)
    assert (r.optimizer, r.lora_fraction, r.workload) == ("adam", 0.01, None)
    assert _request(allow_lora=False).lora_fraction is None


def test_check_request_builds_the_workload_at_the_per_device_batch():
    w = _request(shape={**LLAMA_7B, "seq_len": 2048, "global_batch": 64}, vocab=32000).workload
    assert (w.layers, w.global_batch, w.per_device_batch, w.vocab) == (32, 64, 8, 32000)
    assert (w.layer.batch_size, w.layer.bytes_per_value, w.layer.hidden) == (8, 2, 4096)


def test_check_request_checks_the_layer_options_before_any_estimate():
    # 405B never fits here, so no activation is ever estimated: the check cannot wait for one.
    shape = {**LLAMA_7B, "seq_len": 2048, "global_batch": 64}
    with pytest.raises(ConfigError, match=r"^kv_heads=5: must divide heads=32"):
        _request("405B", shape=shape, allow_lora=False, kv_heads=5)
    with pytest.raises(ConfigError, match=r"^vocab=0: must be an integer >= 1"):
        plan("7B", devices=8, device_memory="80GB", **shape, vocab=0)


def test_methods_try_full_fine_tuning_first_and_lora_only_if_allowed():
    full = _plan._Method("full fine-tuning", None)
    bf16 = _plan._Method("LoRA (0.01 adapters, bf16 frozen base)", 0.01, "bf16")
    assert _plan._methods(_request()) == (full, bf16)
    assert _plan._methods(_request(allow_lora=False)) == (full,)
    assert _plan._methods(_request(quantized_base="nf4", quantized_bytes=10**9)) == (
        full, bf16, _plan._Method("QLoRA (0.01 adapters, nf4 frozen base)", 0.01, "nf4", 10**9))


def test_stage_states_are_model_states_at_each_zero_stage():
    request, lora = _request(), _plan._Method("LoRA", 0.01)
    states = _plan._stage_states(request, lora)
    assert states == tuple(model_states("7B", zero_stage=stage, devices=8, lora_fraction=0.01)
                           for stage in range(4))


def test_activations_are_the_formula_and_say_how_they_add_up():
    w = _request(shape={**LLAMA_7B, "seq_len": 2048, "global_batch": 64}).workload
    acts = _plan._activations(w, 4, "block")
    assert acts.bytes == activation_bytes(**LLAMA_7B, seq_len=2048, batch_size=4,
                                          checkpointing="block")
    assert acts.text.startswith(f"activations {format_bytes(acts.bytes)} (checkpointing: 32 x ")
    assert acts.text.endswith("for the block being recomputed, micro-batch 4)")


def test_fit_whole_batch_stops_at_the_first_stage_that_fits():
    request = _request()
    full = _plan._Method("full fine-tuning", None)
    outcome = _plan._fit_whole_batch(request, full, _plan._stage_states(request, full))
    assert (outcome.choice.stage, outcome.choice.checkpointing, outcome.choice.micro_batch) == (
        1, "none", None)
    assert len(outcome.steps) == 2 and outcome.steps[0].endswith("> 72 GB usable")


def test_fit_whole_batch_says_why_no_stage_fits():
    request = _request("70B")
    full = _plan._Method("full fine-tuning", None)
    outcome = _plan._fit_whole_batch(request, full, _plan._stage_states(request, full))
    assert (outcome.choice, outcome.fitting) == (None, ())
    assert "model states alone need at least 16 such devices" in outcome.why_not
    assert outcome.steps[-1] == "full fine-tuning: model states do not fit at any ZeRO stage"


def test_fit_whole_batch_hands_the_stages_that_fit_to_checkpointing():
    request = _request(shape={**LLAMA_7B, "seq_len": 8192, "global_batch": 64})
    full = _plan._Method("full fine-tuning", None)
    states = _plan._stage_states(request, full)
    whole = _plan._fit_whole_batch(request, full, states)
    assert (whole.choice, whole.fitting) == (None, (1, 2, 3))  # DDP's 112 GB never fits
    smaller = _plan._fit_checkpointed(request, full, states, whole.fitting)
    assert (smaller.choice.stage, smaller.choice.micro_batch) == (3, 4)
    assert len(smaller.steps) == 2  # micro-batch 8 (no stage fits), then 4


def test_result_of_no_fit_has_no_settings():
    request = _request("405B", allow_lora=False)
    p = _plan._result(request, ["-> does not fit: ..."], None)
    assert not p.fits and p.steps == ("-> does not fit: ...",)
    assert all(getattr(p, name) is None for name in ("zero_stage", "lora_fraction",
               "checkpointing", "micro_batch", "grad_accum_steps", "states", "total_bytes"))
    assert (p.usable_bytes, p.optimizer, p.precision) == (72 * GB, "adam", "bf16")


def test_conclusion_counts_the_accumulation_steps():
    request = _request(shape={**LLAMA_7B, "seq_len": 8192, "global_batch": 64})
    states = model_states("7B", zero_stage=3, devices=8)
    choice = _plan._Choice(_plan._Method("full fine-tuning", None), 3, states, "block", 4, 10)
    assert _plan._conclusion(request, choice) == (
        "-> plan: full fine-tuning, mixed precision, ZeRO-3/FSDP, checkpointing=block, "
        "micro-batch 4 x 2 accumulation steps: 14 GB of 72 GB usable per device")


# ---------------------------------------------------------------------------------------------
# plan_mesh: every (data, fsdp, tensor) mesh of the devices, ranked by RULE.
# ---------------------------------------------------------------------------------------------
GPT_1B = {"layers": 16, "hidden": 2048, "heads": 16, "seq_len": 2048}
LLAMA_70B_MHA = {"layers": 80, "hidden": 8192, "heads": 64, "seq_len": 32768}


def _mesh(result, mesh):
    return next(c for c in result.candidates if c.mesh == mesh)


def test_a_small_model_picks_pure_data_parallelism():
    m = plan_mesh("1B", devices=8, device_memory="80GB", **GPT_1B, global_batch=32)
    assert (m.pick.mesh, m.pick.strategy, m.pick.plan.checkpointing) == (
        "data=8,fsdp=1,tensor=1", "ddp", "none")
    # Korthikanti: L x sbh(34 + 5as/h) at b = 32/8 = 4; DDP: 16 B/param.
    s, b, h, a = 2048, 4, 2048, 16
    assert m.pick.plan.total_bytes == 16 * GB + 16 * (34 * s * b * h + 5 * a * s * s * b)
    assert m.pick.communication == 2 * 7 / 8 * 2 * 10**9  # an all-reduce of 2-byte grads
    assert m.pick.tensor_wire_bytes == 0
    # data=4 x tensor=2: half the gradient sync, but 4L all-reduces of p·s·b·h (b = 8).
    t2 = _mesh(m, "data=4,fsdp=1,tensor=2")
    assert t2.plan.fits and t2.strategy == "ddp"
    assert t2.tensor_wire_bytes == 4 * 16 * 2 * (1 / 2) * (2 * s * 8 * h)
    assert t2.communication == 2 * 3 / 4 * 10**9 + t2.tensor_wire_bytes
    # Every mesh fits with DDP here, which shards nothing over fsdp: each tensor degree's
    # meshes are listed once, as data x tensor.
    meshes = [(c.data, c.fsdp, c.tensor) for c in m.candidates]
    assert sorted(meshes) == [(1, 1, 8), (2, 1, 4), (4, 1, 2), (8, 1, 1)]
    assert {c.strategy for c in m.candidates} == {"ddp"}


def test_70b_at_a_long_sequence_fits_only_with_tensor_parallelism():
    m = plan_mesh("70B", devices=8, device_memory="80GB", **LLAMA_70B_MHA, global_batch=8,
                  sequence_parallel=True)
    assert [c.mesh for c in m.candidates if c.plan.fits] == ["data=1,fsdp=1,tensor=8"]
    p = m.pick.plan
    assert (p.lora, p.zero_stage, p.checkpointing, p.micro_batch, p.grad_accum_steps) == (
        True, 0, "block", 1, 8)
    s, h, a, t, L = 32768, 8192, 64, 8, 80
    states = (2 + 16 * 0.01) * 70 * 10**9 / t  # LoRA: frozen bf16 base + 16 B per adapter
    inputs = L * 2 * s * h // t  # sequence-parallel block inputs
    block = s * h * 34 // t + 5 * a * s * s // t  # Korthikanti: sbh(34/t + 5as/(ht))
    assert p.total_bytes == round(states) + inputs + block
    # 6L collectives a micro-batch (checkpointing), doubled by sequence parallelism, each
    # (t-1)/t of p·s·b·h; no gradient sync on one data-parallel rank; 8 micro-batches.
    assert m.pick.communication == 8 * 2 * 6 * L * 7 / 8 * 2 * s * h
    # fsdp=8 keeps whole block inputs (43 GB) and a whole recomputed block: it does not fit.
    fsdp8 = _mesh(m, "data=1,fsdp=8,tensor=1")
    assert not fsdp8.plan.fits and fsdp8.communication is None
    assert "activations do not fit even with checkpointing" in fsdp8.plan.explain()


def test_without_sequence_parallelism_nothing_fits():
    m = plan_mesh("70B", devices=8, device_memory="80GB", **LLAMA_70B_MHA, global_batch=8)
    assert not m.fits and m.pick is None
    text = m.explain()
    assert "-> mesh: nothing fits" in text
    assert text.splitlines()[-1].startswith("-> does not fit")
    assert m.candidates[0].mesh == "data=1,fsdp=8,tensor=1"  # the arithmetic shown


def test_no_recomputation_ranks_before_less_communication():
    m = plan_mesh("7B", devices=16, device_memory="80GB", node_size=4, **LLAMA_7B,
                  seq_len=2048, global_batch=32, vocab=32000, sequence_parallel=True)
    assert (m.pick.mesh, m.pick.strategy, m.pick.plan.checkpointing) == (
        "data=1,fsdp=8,tensor=2", "fsdp", "none")
    cheaper = _mesh(m, "data=8,fsdp=1,tensor=2")  # less traffic, but recomputes every block
    assert cheaper.plan.checkpointing == "block"
    assert cheaper.communication < m.pick.communication
    assert m.candidates.index(cheaper) > 0
    assert "tensor=8 left out: more than a node's 4 devices" in m.notes
    assert max(c.tensor for c in m.candidates) == 4


def test_a_pinned_tensor_degree_is_plan_on_each_split_of_the_rest():
    shape = {**LLAMA_7B, "seq_len": 2048, "global_batch": 16}
    m = plan_mesh("7B", devices=8, device_memory="80GB", tensor=4, **shape)
    assert {c.tensor for c in m.candidates} == {4}
    for c in m.candidates:
        assert c.plan == plan("7B", devices=c.fsdp, data=c.data, tensor=4,
                              device_memory="80GB", **shape)
    assert plan("7B", devices=2, data=1, tensor=4, device_memory="80GB",
                **shape).explain().count("tensor parallel: each of the 2 data-parallel") == 1


def test_lora_traffic_is_the_adapters_gradients_and_the_base_gathers():
    m = plan_mesh("70B", devices=8, device_memory="80GB")  # no shape: tensor=1 only
    assert m.notes[0].startswith("tensor=1 only")
    assert (m.pick.mesh, m.pick.strategy, m.pick.plan.lora) == ("data=1,fsdp=8,tensor=1",
                                                                  "fsdp", True)
    adapters = 3 * 7 / 8 * 0.7e9 * 2  # ZeRO-3 over 0.7e9 adapter parameters
    base = 2 * 7 / 8 * 140e9  # the 2-byte frozen base gathered for forward and backward
    assert m.pick.communication == pytest.approx(adapters + base, rel=1e-12)
    # Hybrid sharding, data=2 x fsdp=4: the states split 4 ways (twice the memory), the
    # traffic counted over the 8 data-parallel ranks as communication() counts it.
    hybrid = _mesh(m, "data=2,fsdp=4,tensor=1")
    assert hybrid.plan.total_bytes == 2 * m.pick.plan.total_bytes == int(37.8 * GB)
    assert hybrid.communication == m.pick.communication


def test_the_global_batch_splits_over_every_mesh():
    p = plan("7B", devices=4, data=2, device_memory="80GB", **LLAMA_7B, seq_len=2048,
             global_batch=16)
    assert p.micro_batch * p.grad_accum_steps == 2  # 16 / (2 x 4)
    assert "batch: global 16 / (2 data x 4 fsdp) devices = 2 sequences per device" in \
        p.explain()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tensor": 3}, r"^tensor=3: does not divide the 8 devices \(they are counted in all: for "
     r"8 groups of 3 devices, give 24\)"),
    ({"tensor": 8, **LLAMA_7B, "seq_len": 128, "global_batch": 8, "vocab": 32001},
     r"^vocab_size=32001: the model: the mesh's tensor=8 does not divide vocab_size=32001"),
    ({**LLAMA_7B, "seq_len": 128, "global_batch": 12},
     r"^global_batch=12: does not divide evenly over 8 devices; use a multiple of 8"),
    ({"tensor": 4, **LLAMA_7B, "seq_len": 128, "global_batch": 5},
     r"^global_batch=5: does not divide evenly over 2 devices; use a multiple of 2"),
    ({"node_size": 0}, r"^node_size=0: must be an integer >= 1"),
    ({"devices": 0}, r"^devices=0: must be an integer >= 1"),
])
def test_plan_mesh_refuses_impossible_requests_in_one_line(kwargs, match):
    args = {"devices": 8, "device_memory": "80GB", **kwargs}
    with pytest.raises(ConfigError, match=match) as e:
        plan_mesh("7B", **args)
    assert "\n" not in str(e.value)


def test_tensor_degrees_the_model_does_not_take_are_left_out_with_a_note():
    m = plan_mesh("1B", devices=8, device_memory="80GB", layers=16, hidden=2048, heads=12,
                  seq_len=512, global_batch=8)
    assert {c.tensor for c in m.candidates} == {1, 2, 4}
    assert any(n.startswith("tensor=8 left out: the model: the mesh's tensor=8 does not "
                            "divide n_heads=12") for n in m.notes)
