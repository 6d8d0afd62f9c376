"""Analytic model-state memory: parameters, gradients and optimizer state, per device.

Model states (Rajbhandari et al. 2020, "ZeRO") are what training keeps whatever the batch:
parameters, gradients, and optimizer state, which under mixed precision includes the f32 master
copy. For Adam under mixed precision that is (2 + 2 + 12) = 16 bytes per parameter, and ZeRO
stages shard them over N data-parallel devices:

    DDP (stage 0)  16Ψ          stage 1  4Ψ + 12Ψ/N
    stage 2        2Ψ + 14Ψ/N   stage 3 (FSDP)  16Ψ/N

:func:`model_states` is the closed form from a parameter count; :func:`estimate_tree` counts the
same fields from a real abstract parameter pytree and a real optax optimizer. Byte counts are
exact integers; GB means 10**9 bytes, the unit that reproduces the published tables (7B Adam =
112 GB).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from effijax.errors import ConfigError, whole_number
from effijax.precision import PRESET_ALIASES

__all__ = [
    "FROZEN_DTYPES",
    "FROZEN_SCALE_BITS",
    "GB",
    "GIB",
    "ModelStateBytes",
    "OPTIMIZERS",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "format_bytes",
    "model_states",
    "parse_bytes",
    "parse_count",
]

GB = 10**9
GIB = 2**30

# Suffixes are matched case-insensitively. Counts: "B" is billion (model sizes), not bytes.
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_COUNT_UNIT_NAMES = "K (1e3), M (1e6), B (1e9), T (1e12), or none"
_BYTE_UNIT_NAMES = (
    "B, KB, MB, GB, TB, PB (powers of 1000), KiB, MiB, GiB, TiB, PiB (powers of 1024)"
)

_NUMBER_UNIT = re.compile(
    r"^\s*(?P<num>[+-]?(?:\d[\d_]*)?(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$"
)

# effijax train's optimizers (effijax.optimizers.OPTIMIZERS, the one list of their names) -> the
# per-parameter state tensors (moments) each keeps, in the moment dtype: Adam(W) m and v, Lion
# and SGD (momentum 0.9, a trace even at momentum 0) one. Adafactor (None) keeps factored second
# moments: r + c values for an r x c matrix at least 128 on both sides (optax's
# min_dim_size_to_factor), a whole v for smaller leaves; so its count depends on the shapes, and
# model_states needs it given (``moments``). A test checks these keys are train's names and the
# counts are what optax allocates.
OPTIMIZERS: dict[str, int | None] = {"adamw": 2, "adam": 2, "lion": 1, "adafactor": None,
                                     "sgd": 1}


@dataclasses.dataclass(frozen=True)
class _PrecisionBytes:
    param: int  # working copy the forward/backward reads
    grad: int
    master: int  # extra f32 copy kept by the optimizer (0 when params are the master)
    moment: int  # each optimizer moment


# The precision policies' names (effijax.precision.PRESETS), counted as the ZeRO paper counts them:
# fp32: the f32 params are the master copy.
# bf16, fp16: 16-bit params and grads, f32 master and moments (DeepSpeed/ZeRO's "mixed precision"
#   accounting, 2 + 2 + 12 for Adam).
# pure_bf16: everything bf16, moments included: what optax.adam/lion/sgd allocate for bf16
#   params (their state takes the parameter dtype); no master copy.
PRECISIONS: dict[str, _PrecisionBytes] = {
    "fp32": _PrecisionBytes(param=4, grad=4, master=0, moment=4),
    "bf16": _PrecisionBytes(param=2, grad=2, master=4, moment=4),
    "fp16": _PrecisionBytes(param=2, grad=2, master=4, moment=4),
    "pure_bf16": _PrecisionBytes(param=2, grad=2, master=0, moment=2),
}
# Other names of the same precisions: the policies' own aliases, and "mixed" (the ZeRO paper's
# name for 16-bit training with f32 master weights; bf16 and fp16 count the same bytes).
PRECISION_ALIASES: dict[str, str] = {"mixed": "bf16", **PRESET_ALIASES}

# Accepted frozen-base (LoRA) dtype names -> storage width in bits, so 4-bit bases (QLoRA)
# count exactly.
FROZEN_DTYPES: dict[str, int] = {
    "fp32": 32,
    "f32": 32,
    "float32": 32,
    "bf16": 16,
    "bfloat16": 16,
    "fp16": 16,
    "f16": 16,
    "float16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
    "nf4": 4,
}
# The quantized bases effijax trains on (effijax.precision.quantize's defaults) carry scales
# beyond their codes: one int8 absmax per 64 weights, one f32 step per 256 of those (QLoRA's
# double quantization). Per weight of a large kernel, in bits; the exact bytes of a real model's
# base (a mean scale per kernel, embeddings and norms unquantized) come from its shapes.
# The floating widths a full fine-tune's reference copy (DPO) may be kept in.
_REFERENCE_DTYPES = ("fp32", "f32", "float32", "bf16", "bfloat16", "fp16", "f16", "float16")

FROZEN_SCALE_BITS: dict[str, Fraction] = {
    "nf4": Fraction(8, 64) + Fraction(32, 64 * 256),
    "int8": Fraction(8, 64) + Fraction(32, 64 * 256),
}

# The largest count and size the parsers take: past any model or device (a larger one only
# overflows the arithmetic that follows).
_MAX_COUNT, _MAX_BYTES = 10**15, 10**18


def _parse_number(value: Any, units: dict[str, int], unit_names: str, example: str,
                  field: str, maximum: int, largest: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(field, value, f"expected a number such as {example}, not a bool")
    if isinstance(value, numbers.Integral):
        number, unit = Decimal(int(value)), ""
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ConfigError(field, value, f"expected a finite number such as {example}")
        number, unit = Decimal(repr(float(value))), ""
    elif isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if match is None or not re.search(r"\d", match["num"]):
            raise ConfigError(
                field, value, f"cannot parse; write a number with an optional unit, e.g. "
                f"{example}; accepted units: {unit_names}"
            )
        try:
            number = Decimal(match["num"].replace("_", ""))
        except InvalidOperation:
            raise ConfigError(field, value, f"{match['num']!r} is not a number") from None
        unit = match["unit"]
    else:
        raise ConfigError(field, value, f"expected an int or a string such as {example}")
    if unit.lower() not in units:
        raise ConfigError(field, value, f"unknown unit {unit!r}; accepted units: {unit_names}")
    if number < 0:
        raise ConfigError(field, value, "must be non-negative")
    result = number * units[unit.lower()]
    if result > maximum:
        raise ConfigError(field, value, f"is more than {largest}; check the number and its "
                          "unit")
    if result != result.to_integral_value():
        raise ConfigError(field, value, f"is not a whole number ({result})")
    return int(result)


def parse_count(value: int | float | str, *, field: str = "value") -> int:
    """Parses a parameter count such as ``"7B"``, ``"70e9"``, ``"1.5M"`` or ``7_000_000_000``.

    Suffixes are decimal and case-insensitive: K = 1e3, M = 1e6, B = 1e9 (billion), T = 1e12.

    Args:
      value: a non-negative int, an integral float, or a string with an optional suffix.
      field: the name of the setting the value is for, used as the error's ``field``.

    Returns:
      The count as an int.

    Raises:
      ConfigError: for negative, non-numeric, non-integral values or unknown suffixes; the
        message lists the accepted suffixes.

    Example:
      >>> parse_count("7B"), parse_count("70e9"), parse_count("1.5M"), parse_count(405_000_000_000)
      (7000000000, 70000000000, 1500000, 405000000000)
      >>> parse_count("7X", field="num_params")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: num_params='7X': unknown unit 'X'; accepted units: K (1e3), ...
    """
    return _parse_number(value, _COUNT_UNITS, _COUNT_UNIT_NAMES, "'7B', '70e9', '1.5M'", field,
                         _MAX_COUNT, "1e15 (1,000T), far beyond any model")


def parse_bytes(value: str, *, field: str = "value") -> int:
    """Parses a memory size such as ``"80GB"`` (80e9), ``"80GiB"`` (80 * 2**30) or ``"512MiB"``.

    KB/MB/GB/TB/PB are powers of 1000, KiB/MiB/GiB/TiB/PiB powers of 1024, B is bytes;
    case-insensitive. Every size in effijax (flags, config files, arguments) goes through this
    one parser. A size needs its unit: a bare number (``"80"``, ``80``) is refused, since
    "80" meant as gigabytes would silently be 80 bytes; write ``"80B"`` for bytes. Zero is the
    one exception (``"0"`` is 0 bytes in every unit: ``--device-memory 0`` skips the check).

    Args:
      value: a string: a non-negative number and a unit.
      field: the name of the setting the value is for, used as the error's ``field``.

    Returns:
      The number of bytes as an int.

    Raises:
      ConfigError: for a bare number, a negative, non-numeric or fractional-byte value, or an
        unknown unit; the message shows the expected form and lists the accepted units.

    Example:
      >>> parse_bytes("80GB"), parse_bytes("80GiB"), parse_bytes("512MiB"), parse_bytes("1.5TB")
      (80000000000, 85899345920, 536870912, 1500000000000)
      >>> parse_bytes("0"), parse_bytes(0), parse_bytes("0B")
      (0, 0, 0)
      >>> parse_bytes("80", field="device_memory")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: device_memory='80': a size needs a unit: write e.g. '80GB' ...
    """
    example = "'80GB', '80GiB', '512MiB'"
    if isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        bare = match is not None and re.search(r"\d", match["num"]) and not match["unit"]
    else:
        bare = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if bare and float(str(value).strip()) == 0:
        return 0
    if bare:
        number = str(value).strip()
        raise ConfigError(field, value, f"a size needs a unit: write e.g. '{number}GB' (10**9 "
                          f"bytes), '{number}GiB' (2**30 bytes), '512MiB', or '{number}B' for "
                          f"bytes; accepted units: {_BYTE_UNIT_NAMES}")
    if not isinstance(value, str):
        raise ConfigError(field, value, f"expected a size with a unit, such as {example}")
    return _parse_number(value, _BYTE_UNITS, _BYTE_UNIT_NAMES, example, field, _MAX_BYTES,
                         "1e18 bytes (1,000,000 TB), far beyond any device")


def format_bytes(num_bytes: int, unit: str | None = None) -> str:
    """Formats a byte count in decimal units (GB = 1e9 bytes), up to two decimals, zeros trimmed.

    Args:
      num_bytes: the count.
      unit: ``"B"``, ``"KB"``, ``"MB"``, ``"GB"``, ``"TB"`` or a binary unit such as ``"GiB"``;
        by default the largest of B, KB, MB, GB not above the value (GB, not TB, for large
        values, as the published tables write 1120 GB).

    Raises:
      ConfigError: for an unknown ``unit``.

    Example:
      >>> format_bytes(1120 * 10**9), format_bytes(18_900_000_000), format_bytes(472_500_000)
      ('1120 GB', '18.9 GB', '472.5 MB')
      >>> format_bytes(2**30, "GiB")
      '1 GiB'
    """
    if unit is None:
        unit = "B"
        for name in ("KB", "MB", "GB"):
            if abs(num_bytes) >= _BYTE_UNITS[name.lower()]:
                unit = name
    if unit.lower() not in _BYTE_UNITS:
        raise ConfigError("unit", unit, f"unknown unit; accepted units: {_BYTE_UNIT_NAMES}")
    text = f"{num_bytes / _BYTE_UNITS[unit.lower()]:.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


@dataclasses.dataclass(frozen=True)
class ModelStateBytes:
    """Per-device bytes of the model states. All byte fields are exact integers.

    Attributes:
      params_bytes: parameters the forward pass reads: trainable parameters in their working dtype
        plus frozen weights (``frozen_bytes``).
      grads_bytes: gradients of the trainable parameters.
      optimizer_bytes: optimizer state, *including* the f32 master copy (``master_bytes``) when
        the master is separate from the working parameters.
      master_bytes: the f32 master copy (part of ``optimizer_bytes``; 0 when params are the master).
      frozen_bytes: frozen weights (part of ``params_bytes``): no gradient, no optimizer state.
      trainable_params: number of trained parameters (adapters under LoRA).
      frozen_params: number of frozen parameters.
      devices: data-parallel devices the states are spread over.
      zero_stage: 0 (DDP) to 3 (FSDP).
      replicated_bytes: bytes (of the fields above) that the ZeRO stage would shard but stay whole
        on every device because no dimension divides by ``devices`` (scalar counters, odd shapes).
        Always 0 from :func:`model_states`.
      compute_copy_bytes: transient copy of the parameters in the compute dtype made inside the
        step (:func:`estimate_tree` only); *not* included in ``model_state_bytes``.
      model_state_bytes: ``params_bytes + grads_bytes + optimizer_bytes``.
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    master_bytes: int
    frozen_bytes: int
    trainable_params: int
    frozen_params: int
    devices: int
    zero_stage: int
    replicated_bytes: int = 0
    compute_copy_bytes: int = 0
    model_state_bytes: int = dataclasses.field(init=False)

    def __post_init__(self):
        total = self.params_bytes + self.grads_bytes + self.optimizer_bytes
        object.__setattr__(self, "model_state_bytes", total)


def _check_choice(name: str, value: Any, accepted) -> str:
    key = value.strip().lower() if isinstance(value, str) else None
    if key not in accepted:
        raise ConfigError(name, value, f"unknown {name}; accepted: {', '.join(accepted)}")
    return key


def _check_moments(optimizer: str, moments: Any) -> int | Fraction:
    """The optimizer-state values per trained parameter: ``moments`` when given, else the
    optimizer's own count (:data:`OPTIMIZERS`)."""
    if moments is None:
        moments = OPTIMIZERS[optimizer]
        if moments is None:
            raise ConfigError("optimizer", optimizer, "keeps factored second moments (r + c "
                              "values per r x c matrix, not r x c), a count that depends on "
                              "the model's shapes: give the model (--model or --from) instead "
                              "of a bare parameter count, or its state values per trained "
                              "parameter as moments")
        return moments
    if (isinstance(moments, bool) or not isinstance(moments, numbers.Rational)
            or moments < 0):
        raise ConfigError("moments", moments, "must be a non-negative int or Fraction "
                          "(optimizer-state values per trained parameter)")
    return moments


def _check_precision(value: Any) -> str:
    """The canonical name (a key of PRECISIONS) of a precision or one of its aliases."""
    key = value.strip().lower() if isinstance(value, str) else None
    key = PRECISION_ALIASES.get(key, key)
    if key not in PRECISIONS:
        raise ConfigError("precision", value, f"unknown precision; accepted: "
                          f"{', '.join(PRECISIONS)} (aliases: {', '.join(PRECISION_ALIASES)})")
    return key


def _check_num_params(value: Any) -> int:
    """Ψ, a parameter count such as ``"7B"`` or ``7_000_000_000``, at least 1."""
    count = parse_count(value, field="num_params")
    if count < 1:
        raise ConfigError("num_params", value, "must be >= 1")
    return count


def _check_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ConfigError("lora_fraction", value, "must be a number in (0, 1] (adapter "
                          "parameters as a fraction of the base model's, e.g. 0.01)")
    return float(value)


def _per_device(count: int, bits: int | Fraction, sharded: bool, devices: int) -> int:
    """Bytes on one device of ``count`` elements of ``bits`` bits, sharded into padded shards."""
    elements = -(-count // devices) if sharded else count
    return math.ceil(elements * Fraction(bits) / 8)


def model_states(
    num_params: int | str,
    *,
    optimizer: str = "adamw",
    precision: str = "bf16",
    zero_stage: int = 0,
    devices: int = 1,
    lora_fraction: float | None = None,
    frozen_dtype: str = "bf16",
    tensor: int = 1,
    frozen_bytes: int | None = None,
    moments: int | Fraction | None = None,
    reference: bool = False,
) -> ModelStateBytes:
    """Closed-form per-device bytes of parameters, gradients and optimizer state.

    Bytes per trained parameter (``precision``, named as the policies of
    :data:`effijax.precision.PRESETS`):

    * ``"fp32"``: params 4 (they are the master), grads 4, each moment 4.
    * ``"bf16"``, ``"fp16"``: params 2, grads 2, f32 master 4, each moment 4: (2 + 2 + 12) for
      Adam, the ZeRO paper's "mixed precision" (``"mixed"`` is accepted as an alias of ``"bf16"``).
      effijax's own train step keeps f32 params and grads instead (4 + 4 + 8, see
      :func:`estimate_tree`): the same total.
    * ``"pure_bf16"``: params 2, grads 2, each moment 2, no master (optax gives bf16 params
      bf16 moments).

    Other spellings (:data:`PRECISION_ALIASES`: ``"mixed"``, ``"float32"``, ``"bfloat16"``,
    ``"half"``, ...) name the same precisions.

    Moments (``optimizer``, :data:`OPTIMIZERS`): ``adamw``/``adam`` 2, ``lion`` 1, ``sgd`` 1
    (effijax's SGD keeps momentum). ``adafactor``'s factored second moments depend on the
    parameters' shapes: give ``moments``, its state values per trained parameter (the
    ``effijax memory`` command counts them from a model's shapes).

    ZeRO: stage >= 1 shards optimizer state (with the master copy), >= 2 also gradients, 3 also
    parameters and frozen weights, each into ``ceil(count / devices)``-element shards.

    LoRA (``lora_fraction`` set), as in Biderman et al. (2024), appendix D: the whole base model
    (``num_params``) is frozen and stored once in ``frozen_dtype``; the adapters add
    ``round(lora_fraction * num_params)`` trainable parameters, with grads, master and moments.
    7B with 1% adapters and Adam: 2Ψ + 16 x 0.01Ψ = 15.12 GB.

    An objective with a reference model (DPO, ``reference``): in full fine-tuning effijax holds
    a frozen copy of the starting weights in ``frozen_dtype`` (a floating width), laid out as
    the parameters are (sharded at stage 3), counted in ``frozen_bytes``; under LoRA the
    reference is the base with the adapters off, and nothing more is held.

    Tensor parallelism (``tensor`` = t) splits every count ``t`` ways before ZeRO shards it over
    ``devices`` (the data-parallel devices of one tensor group's position): Megatron's layout
    splits the attention, MLP and vocabulary matrices, which hold all but the norms' and some
    biases' parameters (under 0.1% of a 7B model; :func:`estimate_tree` with a model's
    ``tensor_layout()`` counts them exactly).

    Args:
      num_params: Ψ, the model's (base) parameter count; an int or a string like ``"7B"``.
      optimizer: one of :data:`OPTIMIZERS` (``effijax train``'s names).
      precision: one of ``fp32``, ``bf16``, ``fp16``, ``pure_bf16``, or an alias.
      zero_stage: 0 (DDP, everything replicated) to 3 (FSDP).
      devices: number of data-parallel devices (>= 1).
      lora_fraction: adapter parameters as a fraction of ``num_params``, in (0, 1]; None for full
        fine-tuning.
      frozen_dtype: storage of the frozen base under LoRA: ``bf16``, ``fp16``, ``fp32``, ``fp8``,
        ``int8``, ``int4``/``nf4``. ``nf4`` and ``int8`` count their double-quantized scales
        too (:data:`FROZEN_SCALE_BITS`: 4.127 bits per parameter for ``nf4``). ``gguf``: a
        GGUF file's own blocks (``--frozen-dtype gguf``), whose ``frozen_bytes`` must be given.
      frozen_bytes: the whole frozen base's exact bytes, when known from the model's shapes
        (``effijax.memory.frozen_base_bytes``) or file
        (``effijax.interop.gguf_kept_bytes``); replaces ``num_params`` x the dtype's bits.
      tensor: the tensor-parallel degree (>= 1).
      moments: optimizer-state values per trained parameter, replacing the optimizer's count
        (required for ``adafactor``, e.g. ``Fraction(values, trained_params)`` from a model's
        shapes).
      reference: the objective compares the policy with a reference model (DPO): in full
        fine-tuning, a frozen copy of the weights in ``frozen_dtype``.

    Returns:
      A :class:`ModelStateBytes` for one device.

    Raises:
      ConfigError: naming the argument, for unknown names, out-of-range stages, devices or
        fractions, or a non-positive parameter count.

    Example:
      >>> model_states("7B").model_state_bytes / GB
      112.0
      >>> model_states("70B", zero_stage=3, devices=8).model_state_bytes / GB
      140.0
      >>> model_states("7B", lora_fraction=0.01, zero_stage=3, devices=8).model_state_bytes / GB
      1.89
      >>> model_states("70B", zero_stage=3, devices=2, tensor=4).model_state_bytes / GB
      140.0
      >>> model_states("70B", lora_fraction=0.01, frozen_dtype="nf4").frozen_bytes / GB
      36.110839844
      >>> model_states("7B", reference=True).frozen_bytes / GB  # full DPO: a bf16 copy
      14.0
      >>> model_states("7B", zero_stage=4)
      Traceback (most recent call last):
      effijax.errors.ConfigError: zero_stage=4: must be an integer from 0 to 3
      >>> model_states("7B", optimizer="adafactor")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: optimizer='adafactor': keeps factored second moments ...
    """
    num_params = _check_num_params(num_params)
    optimizer = _check_choice("optimizer", optimizer, OPTIMIZERS)
    precision = _check_precision(precision)
    zero_stage = whole_number("zero_stage", zero_stage, minimum=0, maximum=3)
    # Plain arithmetic, never sent to a device: no int32 bound (N_d -> infinity is a question).
    devices = whole_number("devices", devices, maximum=None)
    tensor = whole_number("tensor", tensor, maximum=None)
    per = PRECISIONS[precision]
    moments = _check_moments(optimizer, moments)

    if lora_fraction is None and reference:
        frozen_dtype = _check_choice("frozen_dtype", frozen_dtype, FROZEN_DTYPES)
        if frozen_dtype not in _REFERENCE_DTYPES:
            raise ConfigError("frozen_dtype", frozen_dtype, "a full fine-tune's reference copy "
                              "is kept in a floating dtype (fp32, bf16 or fp16)")
        trainable = frozen = frozen_units = num_params
        frozen_bits, frozen_bytes = FROZEN_DTYPES[frozen_dtype], None
    elif lora_fraction is None:
        trainable, frozen, frozen_units, frozen_bits = num_params, 0, 0, 0
    else:
        fraction = _check_fraction(lora_fraction)
        frozen_dtype = _check_choice("frozen_dtype", frozen_dtype, (*FROZEN_DTYPES, "gguf"))
        if frozen_dtype == "gguf" and frozen_bytes is None:
            raise ConfigError("frozen_dtype", "gguf", "a GGUF file's own blocks have no fixed "
                              "width: give their exact frozen_bytes "
                              "(effijax.interop.gguf_kept_bytes of the file)")
        trainable = max(1, round(fraction * num_params))
        frozen = frozen_units = num_params
        frozen_bits = (FROZEN_DTYPES.get(frozen_dtype, 0)
                       + FROZEN_SCALE_BITS.get(frozen_dtype, 0))
        if frozen_bytes is not None:
            # Exact bytes, sharded bytewise (the quantized leaves shard like their kernels).
            frozen_units = whole_number("frozen_bytes", frozen_bytes, maximum=None)

    shard_opt, shard_grads, shard_params = zero_stage >= 1, zero_stage >= 2, zero_stage >= 3
    # One tensor-parallel shard of each count, then ZeRO's split of it over the devices (the
    # exact frozen_bytes, when given, are split bytewise).
    frozen_t, trainable_t = -(-frozen_units // tensor), -(-trainable // tensor)
    frozen_bytes = _per_device(frozen_t, frozen_bits if frozen_bytes is None else 8,
                               shard_params, devices)
    params_bytes = _per_device(trainable_t, 8 * per.param, shard_params, devices) + frozen_bytes
    grads_bytes = _per_device(trainable_t, 8 * per.grad, shard_grads, devices)
    master_bytes = _per_device(trainable_t, 8 * per.master, shard_opt, devices)
    moment_bytes = _per_device(trainable_t, 8 * per.moment * moments, shard_opt, devices)
    return ModelStateBytes(
        params_bytes=params_bytes,
        grads_bytes=grads_bytes,
        optimizer_bytes=master_bytes + moment_bytes,
        master_bytes=master_bytes,
        frozen_bytes=frozen_bytes,
        trainable_params=trainable,
        frozen_params=frozen,
        devices=devices,
        zero_stage=zero_stage,
    )
