"""The analytic estimates against the seeds' formulas, tables and worked examples.

Units: the seed tables are in GB = 10**9 bytes (7B x 16 B = 112e9 bytes = "112 GB"; in GiB it
would be 104.3). Every expected number below is typed from the seeds, not computed by the code
under test.
"""

import dataclasses
import doctest
import math
import re
from decimal import Decimal
from fractions import Fraction

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import effijax.memory._activations
import effijax.memory._estimate
import effijax.memory._plan
from effijax.errors import ConfigError
from effijax.memory import (
    FROZEN_DTYPES,
    FROZEN_SCALE_BITS,
    GB,
    PRECISION_ALIASES,
    PRECISIONS,
    ModelStateBytes,
    activation_bytes,
    estimate_tree,
    format_bytes,
    model_states,
    parse_bytes,
    parse_count,
)


def gb(text: str) -> int:
    """Exact bytes of a decimal GB figure as printed in a seed table."""
    return int(Decimal(text) * GB)


# ---------------------------------------------------------------------------------------------
# Seed 003 (Biderman et al. 2024, appendix D), Tables S1-S3: model + optimizer state per GPU, GB.
# Full fine-tuning: 4 (master) + 4 (grad) + 8 (Adam) or 4 (Lion) bytes per parameter.
# LoRA: 1% adapters (16 B or 12 B each), base stored once in bf16 (2 B), all sharded by FSDP.
# Cells marked "text" are quoted in the seed's prose; the rest follow from its stated formulas.
# ---------------------------------------------------------------------------------------------
SEED_003 = {
    # (model, method, optimizer): (1 GPU, 8 GPUs, 32 GPUs)
    ("7B", "full", "adam"): ("112", "14", "3.5"),  # text: 112, 14, 3.5
    ("7B", "lora", "adam"): ("15.12", "1.89", "0.4725"),  # text: 15.12, 1.89, 0.4725
    ("7B", "full", "lion"): ("84", "10.5", "2.625"),  # text: 84
    ("7B", "lora", "lion"): ("14.84", "1.855", "0.46375"),
    ("70B", "full", "adam"): ("1120", "140", "35"),  # text: 140 on 8 GPUs
    ("70B", "lora", "adam"): ("151.2", "18.9", "4.725"),  # text: 18.9 on 8 GPUs
    ("70B", "full", "lion"): ("840", "105", "26.25"),
    ("70B", "lora", "lion"): ("148.4", "18.55", "4.6375"),
    ("405B", "full", "adam"): ("6480", "810", "202.5"),
    ("405B", "lora", "adam"): ("874.8", "109.35", "27.3375"),
    ("405B", "full", "lion"): ("4860", "607.5", "151.875"),
    ("405B", "lora", "lion"): ("858.6", "107.325", "26.83125"),
}
SEED_003_CELLS = [
    (model, method, opt, devices, cell)
    for (model, method, opt), cells in SEED_003.items()
    for devices, cell in zip((1, 8, 32), cells, strict=True)
]


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
@pytest.mark.parametrize(("model", "method", "optimizer", "devices", "cell"), SEED_003_CELLS)
def test_seed_003_tables(model, method, optimizer, devices, cell, precision):
    # The seed counts fp32 states ("for simplicity we do not account for mixed precision");
    # mixed precision (2 + 2 + 4 master + moments) gives the same bytes per parameter.
    est = model_states(
        model,
        optimizer=optimizer,
        precision=precision,
        zero_stage=3,
        devices=devices,
        lora_fraction=0.01 if method == "lora" else None,
        frozen_dtype="bf16",
    )
    assert est.model_state_bytes == gb(cell)


def test_seed_003_lora_with_fp32_base_is_29_12_gb():
    # "4 x Ψ(1 + 0.01) + 4 x Ψ x 0.01 + 8 x Ψ x 0.01 = 29.12 GB", before storing the base in bf16.
    est = model_states("7B", precision="fp32", lora_fraction=0.01, frozen_dtype="fp32")
    assert est.model_state_bytes == gb("29.12")
    assert est.trainable_params == 70_000_000  # "70M additional parameters"
    assert est.frozen_params == 7_000_000_000
    assert est.frozen_bytes == 4 * 7_000_000_000


def test_seed_003_lora_breakdown_on_8_gpus():
    est = model_states("7B", lora_fraction=0.01, zero_stage=3, devices=8)
    assert est.frozen_bytes == 2 * 7_000_000_000 // 8
    assert est.params_bytes == est.frozen_bytes + 2 * 70_000_000 // 8
    assert est.grads_bytes == 2 * 70_000_000 // 8
    assert est.master_bytes == 4 * 70_000_000 // 8
    assert est.optimizer_bytes == 12 * 70_000_000 // 8


def test_seed_tables_are_decimal_gb_not_gib():
    assert model_states("7B").model_state_bytes == parse_bytes("112GB")
    assert model_states("7B").model_state_bytes != parse_bytes("112GiB")


# Seed 004: (2 + 2 + 12)Ψ and its table: 7B -> 112 GB, 70B -> 1120 GB.
@pytest.mark.parametrize(("model", "cell"), [("7B", "112"), ("70B", "1120")])
def test_seed_004_two_two_twelve(model, cell):
    n = parse_count(model)
    est = model_states(model, optimizer="adam", precision="mixed")
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == (2 * n, 2 * n, 12 * n)
    assert est.master_bytes == 4 * n
    assert est.model_state_bytes == gb(cell)


def test_seed_004_zero1_worked_example():
    # 7.5B: "the standard case requires 120 GB, ... with N_d = 64 only requires 31.4 GB".
    assert model_states("7.5B").model_state_bytes == gb("120")
    z1 = model_states("7.5B", zero_stage=1, devices=64)
    assert z1.model_state_bytes == 4 * 7_500_000_000 + 12 * 7_500_000_000 // 64
    assert round(z1.model_state_bytes / GB, 1) == 31.4
    # N_d -> infinity: 4Ψ, a quarter of the original (K = 12).
    big = model_states("7.5B", zero_stage=1, devices=7_500_000_000)
    assert big.model_state_bytes / model_states("7.5B").model_state_bytes == pytest.approx(
        4 / 16, rel=1e-8
    )


# REFERENCE.md: DDP 16Ψ; ZeRO-1 4Ψ + 12Ψ/N; ZeRO-2 2Ψ + 14Ψ/N; ZeRO-3 16Ψ/N.
ZERO_FORMULAS = {
    0: lambda psi, n: 16 * psi,
    1: lambda psi, n: 4 * psi + 12 * psi // n,
    2: lambda psi, n: 2 * psi + 14 * psi // n,
    3: lambda psi, n: 16 * psi // n,
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("devices", [1, 2, 8, 64])
def test_reference_zero_formulas(stage, devices):
    psi = 6_400_000_000
    est = model_states(psi, zero_stage=stage, devices=devices)
    assert est.model_state_bytes == ZERO_FORMULAS[stage](psi, devices)
    assert (est.devices, est.zero_stage) == (devices, stage)


def test_zero_sharding_pads_to_whole_shards():
    est = model_states(10, zero_stage=3, devices=4)  # ceil(10 / 4) = 3 elements per device
    assert est.model_state_bytes == 3 * 16


def test_optimizers_are_trains_with_the_state_optax_allocates():
    """memory.OPTIMIZERS counts the state of each of effijax train's optimizers (its keys are
    effijax.optimizers.OPTIMIZERS), as optax allocates it for a vector; adafactor (None)
    depends on the shapes and is refused without them."""
    from effijax.memory import OPTIMIZERS
    from effijax.optimizers import OPTIMIZERS as TRAIN_OPTIMIZERS
    from effijax.optimizers import make_optimizer

    assert tuple(OPTIMIZERS) == TRAIN_OPTIMIZERS
    n = 1000
    for name, moments in OPTIMIZERS.items():
        state = jax.eval_shape(make_optimizer(1e-3, 1, optimizer=name).init,
                               {"w": jax.ShapeDtypeStruct((n,), jnp.float32)})
        values = sum(x.size for x in jax.tree.leaves(state) if x.shape == (n,))
        assert values == (1 if moments is None else moments) * n, name
    with pytest.raises(ConfigError, match="optimizer='adafactor': keeps factored"):
        model_states("7B", optimizer="adafactor")
    assert model_states(1000, optimizer="adafactor", moments=1, precision="fp32"
                        ).optimizer_bytes == 4000


@pytest.mark.parametrize(
    ("optimizer", "precision", "per_param"),
    [
        ("adam", "fp32", (4, 4, 8)),
        ("adamw", "mixed", (2, 2, 12)),
        ("adam", "pure_bf16", (2, 2, 4)),
        ("lion", "fp32", (4, 4, 4)),
        ("lion", "mixed", (2, 2, 8)),
        ("lion", "pure_bf16", (2, 2, 2)),
        ("sgd", "mixed", (2, 2, 8)),  # effijax's SGD keeps momentum
        ("sgd", "fp32", (4, 4, 4)),
        ("sgd", "pure_bf16", (2, 2, 2)),
        ("adam", "bf16", (2, 2, 12)),
        ("adam", "fp16", (2, 2, 12)),
        ("lion", "bf16", (2, 2, 8)),
    ],
)
def test_bytes_per_parameter(optimizer, precision, per_param):
    est = model_states(1000, optimizer=optimizer, precision=precision)
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == tuple(
        1000 * b for b in per_param
    )
    assert est.master_bytes == (4000 if precision in ("mixed", "bf16", "fp16") else 0)


def test_precisions_are_the_policies_names():
    from effijax.precision import PRESETS

    assert tuple(PRECISIONS) == tuple(PRESETS) == ("fp32", "bf16", "fp16", "pure_bf16")
    # The default is bf16, the seeds' (2 + 2 + 12) "mixed precision".
    assert model_states("7B") == model_states("7B", precision="bf16")
    assert model_states("7B") == model_states("7B", precision="mixed")
    assert model_states("7B").model_state_bytes == 112 * GB
    # Every alias names the same bytes as its canonical precision, whatever the case.
    assert PRECISION_ALIASES["mixed"] == "bf16"
    for alias, name in PRECISION_ALIASES.items():
        assert model_states("7B", precision=f" {alias.upper()} ") == model_states(
            "7B", precision=name
        )


def test_zero_stages_shard_the_right_fields():
    psi, n = 8000, 8
    s = [model_states(psi, zero_stage=k, devices=n) for k in range(4)]
    assert [x.optimizer_bytes for x in s] == [12 * psi] + [12 * psi // n] * 3
    assert [x.grads_bytes for x in s] == [2 * psi, 2 * psi, 2 * psi // n, 2 * psi // n]
    assert [x.params_bytes for x in s] == [2 * psi, 2 * psi, 2 * psi, 2 * psi // n]
    # LoRA's frozen base is sharded only by ZeRO-3/FSDP.
    lora = [model_states(psi, zero_stage=k, devices=n, lora_fraction=0.5) for k in range(4)]
    assert [x.frozen_bytes for x in lora] == [2 * psi] * 3 + [2 * psi // n]


def test_lora_frozen_dtypes():
    assert model_states("7B", lora_fraction=0.01, frozen_dtype="int4").frozen_bytes == 3_500_000_000
    assert model_states("7B", lora_fraction=0.01, frozen_dtype="fp32").frozen_bytes == 28 * GB
    assert model_states("7B", lora_fraction=1).trainable_params == 7 * GB


def test_model_state_bytes_is_frozen_and_total():
    est = model_states("1B")
    assert isinstance(est, ModelStateBytes)
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.params_bytes = 0
    assert est.model_state_bytes == est.params_bytes + est.grads_bytes + est.optimizer_bytes
    assert dataclasses.replace(est, grads_bytes=0).model_state_bytes == 14 * GB


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "adagrad"}, r"optimizer='adagrad': unknown optimizer; accepted: adamw, "
         "adam, lion, adafactor, sgd"),
        ({"optimizer": ["adam"]}, r"optimizer=\['adam'\]: unknown optimizer"),
        ({"precision": "fp8"}, r"precision='fp8': unknown precision; accepted: fp32, bf16, fp16, "
         r"pure_bf16 \(aliases: mixed, "),
        ({"zero_stage": 4}, r"zero_stage=4: must be an integer from 0 to 3"),
        ({"zero_stage": -1}, r"zero_stage=-1: must be an integer from 0 to 3"),
        ({"devices": 0}, r"devices=0: must be an integer >= 1"),
        ({"devices": 2.0}, r"devices=2\.0: must be an integer"),
        ({"lora_fraction": 0.0}, r"lora_fraction=0\.0: must be a number in \(0, 1\]"),
        ({"lora_fraction": 1.5}, r"lora_fraction=1\.5: must be a number in \(0, 1\]"),
        ({"lora_fraction": 0.1, "frozen_dtype": "int3"}, r"frozen_dtype='int3': unknown "
         "frozen_dtype; accepted"),
    ],
)
def test_model_states_validation(kwargs, match):
    with pytest.raises(ConfigError, match=f"^{match}") as e:
        model_states("7B", **kwargs)
    assert e.value.field == match.split("=")[0]


def test_frozen_dtypes_count_their_bits():
    # effijax's quantized bases (nf4, int8) also store double-quantized scales.
    for name, bits in FROZEN_DTYPES.items():
        est = model_states("7B", lora_fraction=0.01, frozen_dtype=name)
        scales = FROZEN_SCALE_BITS.get(name, 0)
        assert est.frozen_bytes == math.ceil(7 * 10**9 * (bits + scales) / 8), name
    assert FROZEN_DTYPES["nf4"] == 4 and FROZEN_DTYPES["bf16"] == 16
    assert FROZEN_SCALE_BITS["nf4"] == Fraction(8, 64) + Fraction(32, 64 * 256)


@pytest.mark.parametrize(
    ("bad", "match"),
    [("-7B", "must be non-negative"), (0, "must be >= 1"), ("0", "must be >= 1"),
     (-5, "must be non-negative")],
)
def test_model_states_rejects_non_positive_counts(bad, match):
    with pytest.raises(ConfigError, match=f"^num_params={bad!r}: {match}") as e:
        model_states(bad)
    assert (e.value.field, e.value.value) == ("num_params", bad)


# ---------------------------------------------------------------------------------------------
# Parsing.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7B", 7_000_000_000),
        ("7b", 7_000_000_000),
        ("70e9", 70_000_000_000),
        ("405B", 405_000_000_000),
        ("1.5M", 1_500_000),
        ("125K", 125_000),
        ("1T", 10**12),
        (" 7.5B ", 7_500_000_000),
        ("7_000_000", 7_000_000),
        (7_000_000_000, 7_000_000_000),
        (7e9, 7_000_000_000),
        ("0", 0),
        ("1000T", 10**15),  # the largest taken
    ],
)
def test_parse_count(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 1_500_000_000_000),
        ("16 GB", 16 * 10**9),
        ("1024B", 1024),
        ("1024 b", 1024),
        ("2KB", 2000),
        ("0.5KiB", 512),
        ("1000000TB", 10**18),  # the largest taken
        ("0", 0),  # zero needs no unit (--device-memory 0 skips the check)
        (0, 0),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("parse", "bad", "match"),
    [
        (parse_count, "-7B", "must be non-negative"),
        (parse_count, "seven", "cannot parse"),
        (parse_count, "7X", r"unknown unit 'X'.*K \(1e3\), M \(1e6\), B \(1e9\)"),
        (parse_count, "7GB", "unknown unit 'GB'"),
        (parse_count, "1.5", "is not a whole number"),
        (parse_count, "", "cannot parse"),
        (parse_count, None, "expected an int"),
        (parse_count, True, "expected a number"),
        (parse_count, float("nan"), "expected a finite number"),
        (parse_count, "1e30", r"is more than 1e15 \(1,000T\), far beyond any model"),
        (parse_count, "1001T", "is more than 1e15"),
        (parse_bytes, "-1GB", "must be non-negative"),
        (parse_bytes, "80GiBs", r"unknown unit 'GiBs'.*KiB, MiB, GiB"),
        (parse_bytes, "eighty", "cannot parse"),
        (parse_bytes, "1.5B", "is not a whole number"),
        (parse_bytes, "80", r"a size needs a unit: write e.g. '80GB' \(10\*\*9 bytes\), '80GiB'"),
        (parse_bytes, " 1024 ", r"a size needs a unit: write e.g. '1024GB'.*'1024B' for bytes"),
        (parse_bytes, 80 * 10**9, r"a size needs a unit: write e.g. '80000000000GB'"),
        (parse_bytes, 2.5, "a size needs a unit"),
        (parse_bytes, None, "expected a size with a unit"),
        (parse_bytes, "1e400GB", r"is more than 1e18 bytes \(1,000,000 TB\), far beyond any "
         "device"),
    ],
)
def test_parse_errors(parse, bad, match):
    with pytest.raises(ConfigError, match=f"^value={re.escape(repr(bad))}: {match}") as e:
        parse(bad)
    assert e.value.value is bad
    # The caller names its own setting.
    with pytest.raises(ConfigError, match=f"^num_params={re.escape(repr(bad))}: {match}"):
        parse(bad, field="num_params")


def test_format_bytes():
    assert format_bytes(31_406_250_000) == "31.41 GB"
    assert format_bytes(6480 * GB) == "6480 GB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30, "GiB") == "3 GiB"
    with pytest.raises(ConfigError, match=r"^unit='XB': unknown unit; accepted units: B, KB"):
        format_bytes(1, "XB")


# ---------------------------------------------------------------------------------------------
# Seed 004's activation formula: L·p·s·b·h·(16 + 2/p + 2as/h + as/(p·h)).
# ---------------------------------------------------------------------------------------------
def seed_activations_memory(num_layers, seq_len, batch_size, hidden_dim, num_heads, precision=2):
    """Seed 004's own function, re-typed: GB rounded to 2 decimals."""
    mem_bytes = (
        num_layers
        * precision
        * seq_len
        * batch_size
        * hidden_dim
        * (
            16
            + 2 / precision
            + 2 * num_heads * seq_len / hidden_dim
            + num_heads * seq_len / (precision * hidden_dim)
        )
    )
    return round(mem_bytes / 10**9, 2)


def test_activation_formula_hand_computed():
    # L=32, h=4096, a=32, s=2048, b=1, p=2: psbh = 2*2048*4096 = 16,777,216;
    # bracket = 16 + 2/2 + 2*32*2048/4096 + 32*2048/(2*4096) = 16 + 1 + 32 + 8 = 57;
    # 32 * 16,777,216 * 57 = 30,601,641,984 bytes.
    got = activation_bytes(layers=32, hidden=4096, heads=32, seq_len=2048, batch_size=1)
    assert got == 30_601_641_984


@pytest.mark.parametrize(
    ("layers", "seq_len", "batch", "hidden", "heads", "p"),
    [
        (32, 2048, 1, 4096, 32, 2),
        (24, 512, 8, 1024, 16, 2),
        (12, 1024, 4, 768, 12, 4),
        (80, 4096, 1, 8192, 64, 2),
        (2, 100, 3, 60, 5, 1),
    ],
)
def test_activation_formula_matches_seed_function(layers, seq_len, batch, hidden, heads, p):
    got = activation_bytes(
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq_len=seq_len,
        batch_size=batch,
        bytes_per_value=p,
    )
    assert round(got / 10**9, 2) == seed_activations_memory(
        layers, seq_len, batch, hidden, heads, p
    )
    # and term by term, as derived: MLP 9psbh + sbh, attention 5psbh + sbh + 2pas²b + as²b,
    # norms 2psbh.
    s, b, h, a = seq_len, batch, hidden, heads
    mlp = 9 * p * s * b * h + s * b * h
    attention = 5 * p * s * b * h + s * b * h + 2 * p * a * s * s * b + a * s * s * b
    norms = 2 * p * s * b * h
    assert got == layers * (mlp + attention + norms)


SHAPE = {"layers": 4, "hidden": 256, "heads": 8, "seq_len": 512, "batch_size": 2}
L, H, A, S, B, P = 4, 256, 8, 512, 2, 2


def test_dropout_false_removes_only_the_masks():
    full = activation_bytes(**SHAPE)
    assert full - activation_bytes(**SHAPE, dropout=False) == L * (2 * S * B * H + A * S * S * B)


def test_blockwise_attention_replaces_scores_with_row_statistics():
    full = activation_bytes(**SHAPE)
    blockwise = activation_bytes(**SHAPE, blockwise_attention=True)
    scores = 2 * P * A * S * S * B + A * S * S * B  # softmax in/out + attention-dropout mask
    stats = 2 * 4 * A * S * B  # f32 row max and denominator per head
    assert blockwise == full - L * scores + L * stats
    # Without s² terms the cost is linear in s.
    double_s = activation_bytes(**{**SHAPE, "seq_len": 2 * S}, blockwise_attention=True)
    assert double_s == 2 * blockwise
    no_dropout = activation_bytes(**SHAPE, blockwise_attention=True, dropout=False)
    assert blockwise - no_dropout == L * 2 * S * B * H


def test_block_checkpointing_keeps_block_inputs_plus_one_block():
    per_layer = activation_bytes(**SHAPE) // L
    got = activation_bytes(**SHAPE, checkpointing="block")
    assert got == L * P * S * B * H + per_layer
    flash_layer = activation_bytes(**SHAPE, blockwise_attention=True) // L
    got = activation_bytes(**SHAPE, checkpointing="block", blockwise_attention=True)
    assert got == L * P * S * B * H + flash_layer
    # Checkpointing only pays off with more than one layer: L·psbh + layer vs L·layer.
    assert activation_bytes(**{**SHAPE, "layers": 1}, checkpointing="block") > activation_bytes(
        **{**SHAPE, "layers": 1}
    )


def test_activations_scale_linearly_in_batch_and_layers():
    one = activation_bytes(**SHAPE)
    assert activation_bytes(**{**SHAPE, "batch_size": 2 * B}) == 2 * one
    assert activation_bytes(**{**SHAPE, "layers": 3 * L}) == 3 * one


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"checkpointing": "selective"}, r"checkpointing='selective': unknown checkpointing; "
         "accepted: none, block"),
        ({"layers": 0}, "layers=0: must be an integer >= 1"),
        ({"heads": -2}, "heads=-2: must be an integer >= 1"),
        ({"seq_len": 2.5}, r"seq_len=2\.5: must be an integer"),
        ({"bytes_per_value": 0}, "bytes_per_value=0: must be an integer >= 1"),
    ],
)
def test_activation_validation(kwargs, match):
    with pytest.raises(ConfigError, match=f"^{match}") as e:
        activation_bytes(**{**SHAPE, **kwargs})
    assert e.value.field == match.split("=")[0]


# ---------------------------------------------------------------------------------------------
# estimate_tree: a real abstract pytree and a real optax optimizer.
# ---------------------------------------------------------------------------------------------
class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(16)(x)


def _mlp_params():
    return jax.eval_shape(_MLP().init, jax.random.key(0), jnp.zeros((1, 32)))


def _count(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


ADAM_COUNTER = 4  # ScaleByAdamState.count, one int32


def test_estimate_tree_matches_closed_form_adam():
    params = _mlp_params()
    n = _count(params)
    assert n == 32 * 64 + 64 + 2 * 64 + 64 * 16 + 16
    est = estimate_tree(params, optax.adam(1e-3), param_dtype=jnp.float32, compute_dtype="bf16")
    fp32 = model_states(n, optimizer="adam", precision="fp32")
    mixed = model_states(n, optimizer="adam", precision="mixed")
    # Field by field it is the fp32 accounting (f32 params are the master, f32 grads) ...
    assert est.params_bytes == fp32.params_bytes == 4 * n
    assert est.grads_bytes == fp32.grads_bytes == 4 * n
    assert est.optimizer_bytes == fp32.optimizer_bytes + ADAM_COUNTER
    # ... and in total the (2 + 2 + 12) of mixed precision.
    assert est.model_state_bytes == mixed.model_state_bytes + ADAM_COUNTER
    assert est.trainable_params == n and est.frozen_params == 0
    assert est.compute_copy_bytes == 2 * n  # the bf16 cast inside the step, reported apart
    assert est.replicated_bytes == 0


def test_estimate_tree_accepts_arrays():
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _mlp_params())
    a = estimate_tree(params, optax.adam(1e-3), param_dtype="f32", compute_dtype="f32")
    b = estimate_tree(_mlp_params(), optax.adam(1e-3), param_dtype="f32", compute_dtype="f32")
    assert a == b
    assert a.compute_copy_bytes == 0


def _divisible_tree():
    return {
        "emb": jax.ShapeDtypeStruct((512, 64), jnp.float32),
        "w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
        "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32),
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_tree_zero_stages_match_closed_form(stage):
    params = _divisible_tree()
    n = _count(params)
    est = estimate_tree(
        params,
        optax.adam(1e-3),
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        zero_stage=stage,
        devices=8,
    )
    closed = model_states(n, optimizer="adam", precision="fp32", zero_stage=stage, devices=8)
    assert est.params_bytes == closed.params_bytes
    assert est.grads_bytes == closed.grads_bytes
    assert est.optimizer_bytes == closed.optimizer_bytes + ADAM_COUNTER
    # The scalar counter cannot be sharded: replicated although ZeRO >= 1 shards optimizer state.
    assert est.replicated_bytes == (ADAM_COUNTER if stage >= 1 else 0)


def test_estimate_tree_reports_unshardable_leaves():
    params = {**_divisible_tree(), "bias": jax.ShapeDtypeStruct((3, 5), jnp.float32)}
    est = estimate_tree(
        params,
        optax.sgd(0.1),
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        zero_stage=3,
        devices=8,
    )
    n = _count(_divisible_tree())
    # (3, 5): no dimension divides by 8, so its param and grad stay whole on every device.
    assert est.params_bytes == 4 * n // 8 + 4 * 15
    assert est.grads_bytes == 4 * n // 8 + 4 * 15
    assert est.optimizer_bytes == 0  # plain SGD keeps no state
    assert est.replicated_bytes == 2 * 4 * 15


def test_estimate_tree_lion_and_pure_bf16():
    params = _divisible_tree()
    n = _count(params)
    lion = estimate_tree(params, optax.lion(1e-4), param_dtype=jnp.float32, compute_dtype="bf16")
    assert (
        lion.optimizer_bytes
        == model_states(n, optimizer="lion", precision="fp32").optimizer_bytes + 4
    )
    bf16 = estimate_tree(params, optax.adam(1e-3), param_dtype="bf16", compute_dtype="bf16")
    closed = model_states(n, optimizer="adam", precision="pure_bf16")
    assert (bf16.params_bytes, bf16.grads_bytes) == (closed.params_bytes, closed.grads_bytes)
    assert bf16.optimizer_bytes == closed.optimizer_bytes + ADAM_COUNTER  # bf16 moments
    assert bf16.compute_copy_bytes == 0


def test_estimate_tree_lora_mask_matches_closed_form():
    params = {
        "base": {"w": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)},
        "lora": {
            "a": jax.ShapeDtypeStruct((64, 4), jnp.float32),
            "b": jax.ShapeDtypeStruct((4, 64), jnp.float32),
        },
    }
    mask = {"base": {"w": False}, "lora": {"a": True, "b": True}}
    est = estimate_tree(
        params,
        optax.adam(1e-3),
        param_dtype=jnp.float32,
        compute_dtype=jnp.bfloat16,
        trainable=mask,
    )
    assert (est.trainable_params, est.frozen_params) == (512, 4096)
    assert est.frozen_bytes == 2 * 4096
    assert est.grads_bytes == 4 * 512
    closed = model_states(
        4096, optimizer="adam", precision="fp32", lora_fraction=512 / 4096, frozen_dtype="bf16"
    )
    assert est.params_bytes == closed.params_bytes
    assert est.model_state_bytes == closed.model_state_bytes + ADAM_COUNTER
    assert est.compute_copy_bytes == 2 * 512  # only the f32 adapters are cast


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"trainable": {"w1": True}}, r"trainable=PyTreeDef\(\{'w1': \*\}\): must be a pytree "
         "of bools with the structure"),
        ({"trainable": {"emb": True, "w1": 1, "w2": True}}, r"trainable='w1': leaf is 1; "
         "expected True"),
        ({"param_dtype": "float99"}, "param_dtype='float99': not a dtype"),
        ({"zero_stage": 5}, r"zero_stage=5: must be an integer from 0 to 3"),
        ({"devices": 0}, "devices=0: must be an integer >= 1"),
    ],
)
def test_estimate_tree_validation(kwargs, match):
    args = {"param_dtype": jnp.float32, "compute_dtype": jnp.bfloat16, **kwargs}
    with pytest.raises(ConfigError, match=f"^{match}") as e:
        estimate_tree(_divisible_tree(), optax.adam(1e-3), **args)
    assert e.value.field == match.split("=")[0]


def test_estimate_tree_rejects_non_array_leaves():
    with pytest.raises(ConfigError, match=r"^abstract_params='x': leaf is float, not an array"):
        estimate_tree({"x": 1.0}, optax.adam(1e-3), param_dtype="f32", compute_dtype="f32")
    with pytest.raises(ConfigError, match=r"^abstract_params=\{\}: the tree has no leaves"):
        estimate_tree({}, optax.adam(1e-3), param_dtype="f32", compute_dtype="f32")


@pytest.mark.parametrize(
    "module", [effijax.memory._estimate, effijax.memory._activations, effijax.memory._plan]
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
