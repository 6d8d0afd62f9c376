"""The planner's choices on fixed scenarios, and the arithmetic its explanation shows."""

import dataclasses

import pytest

from effijax.errors import ConfigError
from effijax.memory import GB, Plan, _plan, activation_bytes, format_bytes, model_states, plan

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
    assert "precision: bf16 (16-bit params and grads, f32 master and adam state)" in text


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
        ({"optimizer": "adafactor"}, "optimizer='adafactor': unknown optimizer; accepted"),
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
