"""The planner: the cheapest training configuration whose per-device memory fits.

Memory-saving techniques cost something: communication, recomputation, throughput, or (for
LoRA) a different method. :func:`plan` tries them in order of that cost, as in the "strategy
selection" of the study notes on efficient training, and stops at the first that fits:

1. full fine-tuning, bf16 mixed precision, DDP, then ZeRO-1, ZeRO-2 (no extra communication over
   DDP), then ZeRO-3/FSDP (1.5x the communication);
2. activation checkpointing of every block (about one extra forward pass);
3. smaller micro-batches with gradient accumulation, so the global batch stays the same;
4. LoRA with a bf16 frozen base, through the same sequence (a change of method, so last).

A fraction of memory (``headroom``, 10% by default) is kept for what the estimate leaves out:
temporary buffers, collectives' staging, fragmentation, the framework's own allocations.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from decimal import Decimal

from effijax.errors import ConfigError
from effijax.memory._activations import _layer_terms, activation_bytes
from effijax.memory._estimate import (
    FROZEN_DTYPES,
    OPTIMIZERS,
    PRECISIONS,
    ModelStateBytes,
    _check_choice,
    _check_fraction,
    _check_int,
    format_bytes,
    model_states,
    parse_bytes,
    parse_count,
)

__all__ = ["HEADROOM", "Plan", "plan"]

HEADROOM = 0.10
_PRECISION = "bf16"
_STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A recommended configuration and the arithmetic behind it.

    Attributes:
      fits: whether any configuration fits; if False the settings below are None and
        :meth:`explain` says why.
      num_params: Ψ, the model's parameter count.
      devices: data-parallel devices.
      device_memory: bytes of memory per device.
      usable_bytes: ``device_memory`` minus the headroom.
      optimizer: optimizer the states were counted for.
      precision: always ``"bf16"`` (16-bit params and grads, f32 master and moments: the (2 +
        2 + 12) accounting of :func:`model_states`).
      zero_stage: chosen ZeRO stage (0 = DDP).
      lora_fraction: adapter fraction if LoRA was needed, else None.
      checkpointing: ``"none"`` or ``"block"``.
      micro_batch: sequences per device per micro-batch (None without a model shape).
      grad_accum_steps: micro-batches accumulated per step (None without a model shape).
      states: per-device model-state bytes of the chosen configuration.
      activation_bytes: per-device activation bytes (None without a model shape).
      total_bytes: ``states.model_state_bytes`` plus ``activation_bytes``.
      steps: the lines of :meth:`explain`.
    """

    fits: bool
    num_params: int
    devices: int
    device_memory: int
    usable_bytes: int
    optimizer: str
    precision: str
    zero_stage: int | None
    lora_fraction: float | None
    checkpointing: str | None
    micro_batch: int | None
    grad_accum_steps: int | None
    states: ModelStateBytes | None
    activation_bytes: int | None
    total_bytes: int | None
    steps: tuple[str, ...]

    @property
    def lora(self) -> bool:
        """Whether the plan fine-tunes with LoRA instead of full fine-tuning."""
        return self.lora_fraction is not None

    def explain(self) -> str:
        """The arithmetic that led to this plan, one step per line."""
        return "\n".join(self.steps)


def _fmt_count(n: int) -> str:
    for exponent in (12, 9, 6):
        if n >= 10**exponent:
            return f"{n / 10**exponent:g}e{exponent}"
    return str(n)


def _num(x: float) -> str:
    return f"{x:g}"


def _state_formula(optimizer: str, stage: int, devices: int, lora_fraction, frozen_dtype) -> str:
    """Bytes per (base) parameter as the ZeRO paper writes them: '(4 + 12/8)',
    '(2 + 16 x 0.01)/8'."""
    per, moments = PRECISIONS[_PRECISION], OPTIMIZERS[optimizer]
    parts = (
        (per.param, stage >= 3),
        (per.grad, stage >= 2),
        (per.master + moments * per.moment, stage >= 1),
    )
    replicated = sum(b for b, sharded in parts if not sharded)
    sharded = sum(b for b, is_sharded in parts if is_sharded)
    rep_terms, shard_terms = [], []
    if lora_fraction is None:
        rep_terms += [_num(replicated)] if replicated else []
        shard_terms += [_num(sharded)] if sharded else []
    else:
        frozen = _num(FROZEN_DTYPES[frozen_dtype] / 8)
        (shard_terms if stage >= 3 else rep_terms).append(frozen)
        f = _num(lora_fraction)
        rep_terms += [f"{_num(replicated)} x {f}"] if replicated else []
        shard_terms += [f"{_num(sharded)} x {f}"] if sharded else []
    terms = list(rep_terms)
    if shard_terms:
        joined = " + ".join(shard_terms)
        terms.append(f"({joined})/{devices}" if len(shard_terms) > 1 else f"{joined}/{devices}")
    text = " + ".join(terms)
    return f"({text})" if len(terms) > 1 else text


def _divisors_desc(n: int) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def plan(
    num_params: int | str,
    *,
    devices: int,
    device_memory: str,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    optimizer: str = "adam",
    allow_lora: bool = True,
    headroom: float = HEADROOM,
    lora_fraction: float = 0.01,
    dropout: bool = True,
    blockwise_attention: bool = False,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    ffn: int | None = None,
    gated_mlp: bool = False,
    vocab: int | None = None,
) -> Plan:
    """Recommends the cheapest configuration whose model states (and activations) fit.

    Model states come from :func:`model_states` with ``precision="bf16"``; activations, when the
    model shape and global batch are given, from the activation formula
    (:func:`activation_bytes`) with 2-byte values, for a micro-batch of
    ``global_batch / devices / grad_accum_steps`` sequences.
    The order tried is described in the module docstring; the first configuration with
    ``model states + activations <= (1 - headroom) x device_memory`` wins. LoRA uses
    ``lora_fraction`` adapters over a bf16 frozen base.

    Args:
      num_params: Ψ, an int or a string like ``"70B"``.
      devices: data-parallel devices (>= 1).
      device_memory: memory per device with its unit, such as ``"80GB"`` or ``"80GiB"``
        (:func:`~effijax.memory.parse_bytes`; a bare number is refused).
      layers, hidden, heads, seq_len, global_batch: the model shape and the global batch in
        sequences; give all five or none (then only model states are planned).
        ``global_batch`` must divide by ``devices``.
      optimizer: ``adam``, ``adamw``, ``lion``, ``sgd_momentum`` or ``sgd``.
      allow_lora: if False, LoRA is never proposed; a model that needs it does not fit.
      headroom: fraction of ``device_memory`` kept free, in [0, 1).
      lora_fraction: adapter parameters as a fraction of Ψ, in (0, 1].
      dropout: whether activations include dropout masks.
      blockwise_attention: whether attention is blockwise (flash), without s x s scores.
      kv_heads, head_dim, ffn, gated_mlp, vocab: the rest of a model's shape (grouped-query
        attention, a SwiGLU MLP, the logits), as :func:`activation_bytes` takes them; the
        defaults are Korthikanti et al.'s GPT layer without logits.

    Returns:
      A :class:`Plan`; when nothing fits, ``fits`` is False and ``explain()`` says why (no
      exception).

    Raises:
      ConfigError: for invalid arguments (naming the argument), not for a model that does not
        fit.

    Example:
      >>> p = plan("70B", devices=8, device_memory="80GB")
      >>> p.fits, p.lora, p.zero_stage
      (True, True, 3)
      >>> print(p.explain().splitlines()[-2])  # doctest: +NORMALIZE_WHITESPACE
      LoRA (0.01 adapters, bf16 frozen base), ZeRO-3/FSDP: model states
      (2 + 16 x 0.01)/8 B/param x 70e9 = 18.9 GB <= 72 GB usable
    """
    count = parse_count(num_params, field="num_params")
    if count < 1:
        raise ConfigError("num_params", num_params, "must be >= 1")
    num_params = count
    devices = _check_int("devices", devices, 1)
    memory = parse_bytes(device_memory, field="device_memory")
    if memory < 1:
        raise ConfigError("device_memory", device_memory, "must be positive, e.g. '80GB'")
    device_memory = memory
    optimizer = _check_choice("optimizer", optimizer, OPTIMIZERS)
    if (isinstance(headroom, bool) or not isinstance(headroom, numbers.Real)
            or not 0 <= headroom < 1):
        raise ConfigError("headroom", headroom, "must be a fraction in [0, 1) of device_memory "
                          "kept free, e.g. 0.1")
    lora_fraction = _check_fraction(lora_fraction)
    shape = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "seq_len": seq_len,
        "global_batch": global_batch,
    }
    given = [k for k, v in shape.items() if v is not None]
    if given and len(given) < len(shape):
        missing = [k for k in shape if k not in given]
        raise ConfigError(
            missing[0], None, f"required with {', '.join(given)}: activations need all of "
            f"{', '.join(shape)} or none (missing: {', '.join(missing)})"
        )
    for name in given:
        _check_int(name, shape[name], 1)
    if given and global_batch % devices:
        raise ConfigError(
            "global_batch", global_batch, f"does not divide evenly over {devices} devices; use "
            f"a multiple of {devices}"
        )

    usable = int(Decimal(device_memory) * (1 - Decimal(repr(float(headroom)))))
    fmt_usable = format_bytes(usable)
    steps = [
        f"usable memory: {format_bytes(device_memory)} x (1 - {_num(headroom)} headroom) = "
        f"{fmt_usable} per device",
        f"precision: {_PRECISION} (16-bit params and grads, f32 master and {optimizer} state)",
    ]
    per_device_batch = global_batch // devices if given else None
    if given:
        steps.append(
            f"batch: global {global_batch} / {devices} devices = {per_device_batch} sequences "
            "per device"
        )
    else:
        steps.append(
            "activations: not estimated (give layers, hidden, heads, seq_len and global_batch); "
            "planning on model states only"
        )

    def activations(micro: int, checkpointing: str) -> tuple[int, str]:
        shape_args = {
            "hidden": hidden,
            "heads": heads,
            "seq_len": seq_len,
            "batch_size": micro,
            "bytes_per_value": 2,
            "dropout": dropout,
            "blockwise_attention": blockwise_attention,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "ffn": ffn,
            "gated_mlp": gated_mlp,
        }
        total = activation_bytes(layers=layers, checkpointing=checkpointing, vocab=vocab,
                                 **shape_args)
        per_layer = format_bytes(_layer_terms(**shape_args).total)
        if checkpointing == "none":
            how = f"{layers} layers x {per_layer}, no checkpointing"
        else:
            block_input = format_bytes(2 * seq_len * micro * hidden)
            how = (
                f"checkpointing: {layers} x {block_input} block inputs + "
                f"{per_layer} for the block being recomputed"
            )
        if vocab is not None:
            how += f" + {format_bytes(4 * seq_len * micro * vocab)} f32 logits"
        text = f"activations {format_bytes(total)} ({how}, micro-batch {micro})"
        return total, text

    methods: list[tuple[str, float | None]] = [("full fine-tuning", None)]
    if allow_lora:
        methods.append((f"LoRA ({_num(lora_fraction)} adapters, bf16 frozen base)", lora_fraction))

    def result(label, fraction, stage, states, checkpointing, micro, acts):
        total = states.model_state_bytes + (acts or 0)
        batch = ""
        if micro is not None:
            accum = per_device_batch // micro
            batch = (
                f", checkpointing={checkpointing}, micro-batch {micro} x {accum} accumulation "
                f"step{'s' if accum > 1 else ''}"
            )
        steps.append(
            f"-> plan: {label}, mixed precision, {_STAGE_NAMES[stage]}{batch}: "
            f"{format_bytes(total)} of {fmt_usable} usable per device"
        )
        return Plan(
            fits=True,
            num_params=num_params,
            devices=devices,
            device_memory=device_memory,
            usable_bytes=usable,
            optimizer=optimizer,
            precision=_PRECISION,
            zero_stage=stage,
            lora_fraction=fraction,
            checkpointing=checkpointing,
            micro_batch=micro,
            grad_accum_steps=None if micro is None else per_device_batch // micro,
            states=states,
            activation_bytes=acts,
            total_bytes=total,
            steps=tuple(steps),
        )

    why_not = []
    for label, fraction in methods:
        states = {
            stage: model_states(
                num_params,
                optimizer=optimizer,
                precision=_PRECISION,
                zero_stage=stage,
                devices=devices,
                lora_fraction=fraction,
            )
            for stage in range(4)
        }
        # 1. ZeRO stages, no checkpointing, the whole per-device batch at once.
        fitting = []
        for stage in range(4):
            st = states[stage]
            head = (
                f"{label}, {_STAGE_NAMES[stage]}: model states "
                f"{_state_formula(optimizer, stage, devices, fraction, 'bf16')} B/param x "
                f"{_fmt_count(num_params)} = {format_bytes(st.model_state_bytes)}"
            )
            if st.model_state_bytes > usable:
                steps.append(f"{head} > {fmt_usable} usable")
                continue
            fitting.append(stage)
            if not given:
                steps.append(f"{head} <= {fmt_usable} usable")
                return result(label, fraction, stage, st, "none", None, None)
            acts, acts_text = activations(per_device_batch, "none")
            total = st.model_state_bytes + acts
            fits = total <= usable
            steps.append(
                f"{head} + {acts_text} = {format_bytes(total)} "
                f"{'<=' if fits else '>'} {fmt_usable} usable"
            )
            if fits:
                return result(label, fraction, stage, st, "none", per_device_batch, acts)
        if not fitting:
            smallest = states[3].model_state_bytes
            unsharded = model_states(
                num_params, optimizer=optimizer, precision=_PRECISION, lora_fraction=fraction
            ).model_state_bytes
            need = math.ceil(unsharded / usable)
            why_not.append(
                f"{label}: model states exceed {fmt_usable} at every ZeRO stage (ZeRO-3: "
                f"{format_bytes(smallest)}); model states alone need at least {need} such devices"
            )
            steps.append(f"{label}: model states do not fit at any ZeRO stage")
            continue
        # 2. Activation checkpointing, then 3. smaller micro-batches with accumulation.
        for micro in _divisors_desc(per_device_batch):
            acts, acts_text = activations(micro, "block")
            for stage in fitting:
                total = states[stage].model_state_bytes + acts
                if total <= usable:
                    steps.append(
                        f"{label}, {_STAGE_NAMES[stage]}: model states "
                        f"{format_bytes(states[stage].model_state_bytes)} + {acts_text} = "
                        f"{format_bytes(total)} <= {fmt_usable} usable"
                    )
                    return result(label, fraction, stage, states[stage], "block", micro, acts)
            best = fitting[-1]
            steps.append(
                f"{label}, {_STAGE_NAMES[best]}: model states "
                f"{format_bytes(states[best].model_state_bytes)} + {acts_text} = "
                f"{format_bytes(states[best].model_state_bytes + acts)} > {fmt_usable} usable"
            )
        why_not.append(
            f"{label}: activations do not fit even with checkpointing and micro-batch 1 "
            "(shorten seq_len, use blockwise attention, or add tensor/sequence parallelism)"
        )
    if not allow_lora:
        why_not.append("LoRA not tried (allow_lora=False)")
    steps.append("-> does not fit: " + "; ".join(why_not))
    return Plan(
        fits=False,
        num_params=num_params,
        devices=devices,
        device_memory=device_memory,
        usable_bytes=usable,
        optimizer=optimizer,
        precision=_PRECISION,
        zero_stage=None,
        lora_fraction=None,
        checkpointing=None,
        micro_batch=None,
        grad_accum_steps=None,
        states=None,
        activation_bytes=None,
        total_bytes=None,
        steps=tuple(steps),
    )
