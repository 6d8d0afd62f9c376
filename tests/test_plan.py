"""The planner's choices on fixed scenarios, and the arithmetic its explanation shows."""

import dataclasses

import pytest

from effijax.errors import ConfigError
from effijax.memory import GB, Plan, activation_bytes, model_states, plan

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
        ({"devices": 0}, "devices=0: must be a whole number >= 1"),
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
