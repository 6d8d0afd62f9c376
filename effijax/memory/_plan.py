"""The planner: the cheapest training configuration whose per-device memory fits.

Memory-saving techniques cost something: communication, recomputation, throughput, or (for
LoRA) a different method. :func:`plan` tries them in order of that cost, as in the "strategy
selection" of the study notes on efficient training, and stops at the first that fits:

1. full fine-tuning, bf16 mixed precision, DDP, then ZeRO-1, ZeRO-2 (no extra communication over
   DDP), then ZeRO-3/FSDP (1.5x the communication);
2. activation checkpointing of every block (about one extra forward pass);
3. smaller micro-batches with gradient accumulation, so the global batch stays the same;
4. LoRA with a bf16 frozen base, through the same sequence (a change of method, so last);
5. when asked (``quantized_base="nf4"``), LoRA on a quantized frozen base (QLoRA: quantization
   error in the frozen weights, and dequantization in every step).

A fraction of memory (``headroom``, 10% by default) is kept for what the estimate leaves out:
temporary buffers, collectives' staging, fragmentation, the framework's own allocations.

This plans one mesh; :func:`~effijax.memory.plan_mesh` runs it on every ``(data, fsdp, tensor)``
mesh of a device count and picks one.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from decimal import Decimal
from typing import Any, NamedTuple

from effijax.errors import INT32_MAX, ConfigError, whole_number
from effijax.memory._activations import (
    _check_context,
    _check_layer_options,
    _check_tensor,
    _Layer,
    _stack_bytes,
)
from effijax.memory._estimate import (
    FROZEN_DTYPES,
    FROZEN_SCALE_BITS,
    OPTIMIZERS,
    PRECISIONS,
    ModelStateBytes,
    _check_choice,
    _check_fraction,
    _check_num_params,
    format_bytes,
    model_states,
    parse_bytes,
)

__all__ = ["HEADROOM", "Plan", "plan"]

HEADROOM = 0.10
_PRECISION = "bf16"
_STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}


_BOUND = (", at most 1 value per parameter: its factored second moments keep r + c per r x c "
          "matrix, effijax memory --model counts them exactly")


def _moments(optimizer: str) -> int:
    """Optimizer-state values per parameter the plan counts: the optimizer's own, and for
    adafactor (whose factored moments depend on each matrix's shape) 1, its bound: a whole v
    per leaf, what it keeps for leaves below 128 on a side, more than r + c for larger ones. A
    plan that fits so fits adafactor's real state."""
    count = OPTIMIZERS[optimizer]
    return 1 if count is None else count


@dataclasses.dataclass(frozen=True)
class Plan:
    """A recommended configuration and the arithmetic behind it.

    Attributes:
      fits: whether any configuration fits; if False the settings below are None and
        :meth:`explain` says why.
      num_params: Ψ, the model's parameter count.
      devices: the devices the ZeRO stages shard over (a mesh's ``fsdp`` axis: all the
        data-parallel devices when ``data`` is 1).
      device_memory: bytes of memory per device.
      usable_bytes: ``device_memory`` minus the headroom.
      optimizer: optimizer the states were counted for.
      precision: always ``"bf16"`` (16-bit params and grads, f32 master and moments: the (2 +
        2 + 12) accounting of :func:`model_states`).
      zero_stage: chosen ZeRO stage (0 = DDP).
      lora_fraction: adapter fraction if LoRA was needed, else None.
      frozen_dtype: the LoRA base's storage (``bf16``, or the quantized base that made it fit),
        None without LoRA.
      checkpointing: ``"none"`` or ``"block"``.
      micro_batch: sequences per device per micro-batch (None without a model shape).
      grad_accum_steps: micro-batches accumulated per step (None without a model shape).
      states: per-device model-state bytes of the chosen configuration.
      activation_bytes: per-device activation bytes (None without a model shape).
      total_bytes: ``states.model_state_bytes`` plus ``activation_bytes``.
      steps: the lines of :meth:`explain`.
      tensor: the tensor-parallel degree planned for (each of the ``devices`` data-parallel
        ranks is a group of ``tensor`` devices).
      data: replicas of the ``devices`` group (a mesh's ``data`` axis, ``devices`` being its
        ``fsdp`` axis): the batch splits over ``data x devices``, the model states over
        ``devices`` only.
      sequence_parallel: whether the activations were counted with sequence parallelism.
      context: the context-parallel degree planned for (each sequence split over ``context``
        devices of every data-parallel rank; 1: none).
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
    frozen_dtype: str | None
    checkpointing: str | None
    micro_batch: int | None
    grad_accum_steps: int | None
    states: ModelStateBytes | None
    activation_bytes: int | None
    total_bytes: int | None
    steps: tuple[str, ...]
    tensor: int = 1
    data: int = 1
    sequence_parallel: bool = False
    context: int = 1

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


def _frozen_per_param(method: _Method, num_params: int) -> float:
    """The frozen base's bytes per parameter: exact when its bytes are known."""
    if method.frozen_bytes is not None:
        return method.frozen_bytes / num_params
    dtype = method.frozen_dtype
    return float(FROZEN_DTYPES[dtype] + FROZEN_SCALE_BITS.get(dtype, 0)) / 8


def _state_formula(optimizer: str, stage: int, devices: int, lora_fraction,
                   frozen_per_param: float, tensor: int = 1, reference: bool = False) -> str:
    """Bytes per (base) parameter as the ZeRO paper writes them: '(4 + 12/8)',
    '(2 + 16 x 0.01)/8', and split over a tensor degree: '(4 + 12/2)/4'; ``reference``: full
    fine-tuning's frozen reference copy (DPO) adds its bytes, '(2 + 2 + 14/8)'."""
    per, moments = PRECISIONS[_PRECISION], _moments(optimizer)
    parts = (
        (per.param, stage >= 3),
        (per.grad, stage >= 2),
        (per.master + moments * per.moment, stage >= 1),
    )
    replicated = sum(b for b, sharded in parts if not sharded)
    sharded = sum(b for b, is_sharded in parts if is_sharded)
    rep_terms, shard_terms = [], []
    if lora_fraction is None:
        if reference:  # laid out as the parameters are
            replicated += 0 if stage >= 3 else per.param
            sharded += per.param if stage >= 3 else 0
        rep_terms += [_num(replicated)] if replicated else []
        shard_terms += [_num(sharded)] if sharded else []
    else:
        frozen = _num(round(frozen_per_param, 4))
        (shard_terms if stage >= 3 else rep_terms).append(frozen)
        f = _num(lora_fraction)
        rep_terms += [f"{_num(replicated)} x {f}"] if replicated else []
        shard_terms += [f"{_num(sharded)} x {f}"] if sharded else []
    terms = list(rep_terms)
    if shard_terms:
        joined = " + ".join(shard_terms)
        terms.append(f"({joined})/{devices}" if len(shard_terms) > 1 else f"{joined}/{devices}")
    text = " + ".join(terms)
    text = f"({text})" if len(terms) > 1 else text
    if tensor > 1:
        text = f"{text}/{tensor}" if len(terms) > 1 or "/" not in text else f"({text})/{tensor}"
    return text


def _divisors_desc(n: int) -> list[int]:
    """The divisors of ``n``, largest first, found in pairs up to its square root (the batch
    is at most INT32_MAX: 46,341 trials at most).

    Example:
      >>> _divisors_desc(12)
      [12, 6, 4, 3, 2, 1]
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)



# The passes, in the order plan() runs them: 1. check the arguments (_check_request);
# 2. list the methods to try (_methods); 3. estimate model states and activations
# (_stage_states, _activations); 4. find the first configuration that fits (_fit_whole_batch,
# then _fit_checkpointed); 5. write the explanation and the Plan (_preamble, _conclusion,
# _result). Each takes and returns the small records below.


class _Workload(NamedTuple):
    """The model's shape and the batch, checked: what activations are counted from."""

    layers: int
    global_batch: int
    per_device_batch: int
    layer: _Layer  # one layer at the whole per-device batch, in 2-byte (bf16) values
    vocab: int | None


@dataclasses.dataclass(frozen=True)
class _Request:
    """plan()'s arguments, checked, in the units the passes use."""

    num_params: int
    devices: int
    device_memory: int  # bytes
    usable: int  # bytes: device_memory less the headroom
    headroom: float  # as given: the explanation prints it
    optimizer: str
    lora_fraction: float | None  # None where LoRA is not allowed
    workload: _Workload | None  # None: planning on model states only
    tensor: int = 1  # each data-parallel rank is a group of this many devices
    data: int = 1  # replicas of the devices group: the batch splits over data x devices
    sequence_parallel: bool = False
    context: int = 1  # each sequence split over this many devices of every rank
    quantized_base: str | None = None  # also try LoRA on this quantized base (nf4, int8)
    quantized_bytes: int | None = None  # that base's exact bytes, when the model's shapes are known
    reference: bool = False  # the objective holds a reference (DPO): a copy in full fine-tuning


class _Method(NamedTuple):
    """Full fine-tuning (``lora_fraction`` None) or LoRA with that adapter fraction, on a base
    stored as ``frozen_dtype`` (exactly ``frozen_bytes`` when known)."""

    label: str
    lora_fraction: float | None
    frozen_dtype: str = "bf16"
    frozen_bytes: int | None = None


class _Acts(NamedTuple):
    """Activation bytes of one micro-batch size and checkpointing, and how they add up."""

    bytes: int
    text: str


class _Choice(NamedTuple):
    """A configuration that fits."""

    method: _Method
    stage: int
    states: ModelStateBytes
    checkpointing: str
    micro_batch: int | None  # None without a workload
    activation_bytes: int | None  # None without a workload

    @property
    def total_bytes(self) -> int:
        return self.states.model_state_bytes + (self.activation_bytes or 0)


class _Outcome(NamedTuple):
    """What trying one method found: its explanation lines, and a choice or why none fits."""

    steps: tuple[str, ...]
    choice: _Choice | None = None
    fitting: tuple[int, ...] = ()  # ZeRO stages whose model states fit (activations aside)
    why_not: str | None = None


def _check_workload(shape: dict[str, Any], layer_options: dict[str, Any], vocab: int | None,
                    devices: int, tensor: int = 1, data: int = 1,
                    sequence_parallel: bool = False, context: int = 1) -> _Workload | None:
    """The model shape and global batch (``shape``: all five or none), checked.

    Returns None when ``shape`` is all None: the plan then counts model states only, and
    ``layer_options`` and ``vocab`` are not used.
    """
    given = [k for k, v in shape.items() if v is not None]
    if not given:
        return None
    if len(given) < len(shape):
        missing = [k for k in shape if k not in given]
        raise ConfigError(
            missing[0], None, f"required with {', '.join(given)}: activations need all of "
            f"{', '.join(shape)} or none (missing: {', '.join(missing)})"
        )
    for name in given:
        # The global batch has train's --batch-size ceiling (INT32_MAX): the search tries
        # the per-device batch's divisors, and nothing larger is a batch one step takes.
        whole_number(name, shape[name], maximum=INT32_MAX if name == "global_batch" else None)
    ranks = data * devices
    if shape["global_batch"] % ranks:
        raise ConfigError(
            "global_batch", shape["global_batch"], f"does not divide evenly over {ranks} "
            f"devices; use a multiple of {ranks}"
        )
    _check_layer_options(shape["heads"], layer_options["kv_heads"], layer_options["head_dim"],
                         layer_options["ffn"], vocab)
    _check_tensor(tensor, shape["heads"], sequence_parallel)
    _check_context(context, shape["seq_len"], layer_options["dropout"])
    per_device = shape["global_batch"] // ranks
    layer = _Layer(hidden=shape["hidden"], heads=shape["heads"], seq_len=shape["seq_len"],
                   batch_size=per_device, bytes_per_value=2, tensor=tensor,
                   sequence_parallel=sequence_parallel, context=context, **layer_options)
    return _Workload(shape["layers"], shape["global_batch"], per_device, layer, vocab)


def _check_request(num_params, *, devices, device_memory, optimizer, headroom, allow_lora,
                   lora_fraction, shape: dict[str, Any], layer_options: dict[str, Any],
                   vocab, tensor: int = 1, quantized_base: str | None = None,
                   quantized_bytes: int | None = None, data: int = 1,
                   sequence_parallel: bool = False, reference: bool = False,
                   context: int = 1) -> _Request:
    """Pass 1: plan()'s arguments checked, in plan()'s order, and converted.

    ``shape``, ``layer_options`` and ``vocab`` are :func:`_check_workload`'s.

    Raises:
      ConfigError: naming the first bad argument.
    """
    num_params = _check_num_params(num_params)
    devices = whole_number("devices", devices, maximum=None)
    memory = parse_bytes(device_memory, field="device_memory")
    if memory < 1:
        raise ConfigError("device_memory", device_memory, "must be positive, e.g. '80GB'")
    optimizer = _check_choice("optimizer", optimizer, OPTIMIZERS)
    if (isinstance(headroom, bool) or not isinstance(headroom, numbers.Real)
            or not 0 <= headroom < 1):
        raise ConfigError("headroom", headroom, "must be a fraction in [0, 1) of device_memory "
                          "kept free, e.g. 0.1")
    lora_fraction = _check_fraction(lora_fraction)
    tensor = whole_number("tensor", tensor, maximum=None)
    data = whole_number("data", data, maximum=None)
    context = whole_number("context", context, maximum=None)
    if not isinstance(sequence_parallel, bool):
        raise ConfigError("sequence_parallel", sequence_parallel, "expected True or False")
    if quantized_base is not None and quantized_base not in FROZEN_SCALE_BITS:
        raise ConfigError("quantized_base", quantized_base, "choose one of "
                          f"{', '.join(FROZEN_SCALE_BITS)}, or None for a bf16 base only")
    if quantized_bytes is not None:
        whole_number("quantized_bytes", quantized_bytes, maximum=None)
    if not isinstance(reference, bool):
        raise ConfigError("reference", reference, "expected True or False")
    return _Request(
        num_params=num_params,
        devices=devices,
        device_memory=memory,
        # Decimal of the float's repr: 0.1 headroom of 80 GB leaves exactly 72 GB.
        usable=int(Decimal(memory) * (1 - Decimal(repr(float(headroom))))),
        headroom=headroom,
        optimizer=optimizer,
        lora_fraction=lora_fraction if allow_lora else None,
        workload=_check_workload(shape, layer_options, vocab, devices, tensor, data,
                                 sequence_parallel, context),
        tensor=tensor,
        data=data,
        sequence_parallel=sequence_parallel,
        context=context,
        quantized_base=quantized_base,
        quantized_bytes=quantized_bytes,
        reference=reference,
    )


def _methods(request: _Request) -> tuple[_Method, ...]:
    """Pass 2: the methods to try, cheapest first: full fine-tuning, then LoRA if allowed, then
    LoRA on a quantized base if asked for."""
    full = _Method("full fine-tuning" + (" with a bf16 reference copy" if request.reference
                                         else ""), None)
    fraction = request.lora_fraction
    if fraction is None:
        return (full,)
    lora = _Method(f"LoRA ({_num(fraction)} adapters, bf16 frozen base)", fraction)
    if request.quantized_base is None:
        return full, lora
    q = request.quantized_base
    return full, lora, _Method(f"QLoRA ({_num(fraction)} adapters, {q} frozen base)", fraction,
                               q, request.quantized_bytes)


def _stage_states(request: _Request, method: _Method) -> tuple[ModelStateBytes, ...]:
    """Pass 3a: the method's per-device model states at ZeRO stages 0 to 3 (by index)."""
    return tuple(
        model_states(
            request.num_params,
            optimizer=request.optimizer,
            precision=_PRECISION,
            zero_stage=stage,
            devices=request.devices,
            lora_fraction=method.lora_fraction,
            tensor=request.tensor,
            frozen_dtype=method.frozen_dtype,
            frozen_bytes=method.frozen_bytes,
            moments=_moments(request.optimizer),
            reference=request.reference,
        )
        for stage in range(4)
    )


def _activations(workload: _Workload, micro: int, checkpointing: str) -> _Acts:
    """Pass 3b: activation bytes of ``micro`` sequences per micro-batch, and their sum as text."""
    layer = dataclasses.replace(workload.layer, batch_size=micro)
    total = _stack_bytes(layer, workload.layers, checkpointing, workload.vocab)
    per_layer = format_bytes(layer.terms().total)
    if checkpointing == "none":
        how = f"{workload.layers} layers x {per_layer}, no checkpointing"
    else:
        how = (
            f"checkpointing: {workload.layers} x {format_bytes(layer.input_bytes())} block "
            f"inputs + {per_layer} for the block being recomputed"
        )
    if workload.vocab is not None:
        how += f" + {format_bytes(layer.logits_bytes(workload.vocab))} fused head and loss"
    return _Acts(total, f"activations {format_bytes(total)} ({how}, micro-batch {micro})")


def _against(total: int, usable: int) -> str:
    """``<= 72 GB usable`` or ``> 72 GB usable``: the verdict that ends a line of the search."""
    return f"{'<=' if total <= usable else '>'} {format_bytes(usable)} usable"


def _fit_whole_batch(request: _Request, method: _Method,
                     states: tuple[ModelStateBytes, ...]) -> _Outcome:
    """Pass 4a: each ZeRO stage in turn, without checkpointing, the whole per-device batch at
    once; the first stage that fits wins.

    Without a choice, the outcome lists the stages whose model states fit (for pass 4b), or,
    when none does, says why not.
    """
    workload, usable = request.workload, request.usable
    acts = None if workload is None else _activations(workload, workload.per_device_batch, "none")
    steps, fitting = [], []
    for stage, st in enumerate(states):
        formula = _state_formula(request.optimizer, stage, request.devices, method.lora_fraction,
                                 _frozen_per_param(method, request.num_params), request.tensor,
                                 request.reference)
        head = (
            f"{method.label}, {_STAGE_NAMES[stage]}: model states {formula} B/param x "
            f"{_fmt_count(request.num_params)} = {format_bytes(st.model_state_bytes)}"
        )
        if st.model_state_bytes > usable or acts is None:
            steps.append(f"{head} {_against(st.model_state_bytes, usable)}")
            if st.model_state_bytes > usable:
                continue
            return _Outcome(tuple(steps), _Choice(method, stage, st, "none", None, None))
        fitting.append(stage)
        total = st.model_state_bytes + acts.bytes
        steps.append(f"{head} + {acts.text} = {format_bytes(total)} {_against(total, usable)}")
        if total <= usable:
            choice = _Choice(method, stage, st, "none", workload.per_device_batch, acts.bytes)
            return _Outcome(tuple(steps), choice)
    if fitting:
        return _Outcome(tuple(steps), fitting=tuple(fitting))
    steps.append(f"{method.label}: model states do not fit at any ZeRO stage")
    # DDP shards nothing: its model states are the whole model's.
    need = math.ceil(states[0].model_state_bytes / usable)
    why_not = (
        f"{method.label}: model states exceed {format_bytes(usable)} at every ZeRO stage "
        f"(ZeRO-3: {format_bytes(states[3].model_state_bytes)}); model states alone need at "
        f"least {need} such devices"
    )
    return _Outcome(tuple(steps), why_not=why_not)


def _fit_checkpointed(request: _Request, method: _Method, states: tuple[ModelStateBytes, ...],
                      fitting: tuple[int, ...]) -> _Outcome:
    """Pass 4b: block checkpointing, then ever smaller micro-batches (accumulated back to the
    same global batch), at the stages in ``fitting``; the first that fits wins.

    Each micro-batch size adds one line: the first stage that fits, or else the most sharded
    one's shortfall.
    """
    workload, usable = request.workload, request.usable
    steps = []
    for micro in _divisors_desc(workload.per_device_batch):
        acts = _activations(workload, micro, "block")
        stage = next((s for s in fitting if states[s].model_state_bytes + acts.bytes <= usable),
                     fitting[-1])
        total = states[stage].model_state_bytes + acts.bytes
        steps.append(
            f"{method.label}, {_STAGE_NAMES[stage]}: model states "
            f"{format_bytes(states[stage].model_state_bytes)} + {acts.text} = "
            f"{format_bytes(total)} {_against(total, usable)}"
        )
        if total <= usable:
            choice = _Choice(method, stage, states[stage], "block", micro, acts.bytes)
            return _Outcome(tuple(steps), choice)
    why_not = (
        f"{method.label}: activations do not fit even with checkpointing and micro-batch 1 "
        "(shorten seq_len, use blockwise attention, or add tensor/sequence parallelism or a "
        "context axis)"
    )
    return _Outcome(tuple(steps), why_not=why_not)


def _try_method(request: _Request, method: _Method) -> _Outcome:
    """Passes 3 and 4 for one method: its first configuration that fits, if any."""
    states = _stage_states(request, method)
    whole = _fit_whole_batch(request, method, states)
    if whole.choice is not None or not whole.fitting:
        return whole
    smaller = _fit_checkpointed(request, method, states, whole.fitting)
    return smaller._replace(steps=whole.steps + smaller.steps)


def _preamble(request: _Request) -> tuple[str, ...]:
    """Pass 5a: the explanation's first lines: usable memory, precision, batch."""
    workload = request.workload
    if workload is None:
        batch = ("activations: not estimated (give layers, hidden, heads, seq_len and "
                 "global_batch); planning on model states only")
    else:
        over = (f"{request.devices} devices" if request.data == 1 else
                f"({request.data} data x {request.devices} fsdp) devices")
        batch = (f"batch: global {workload.global_batch} / {over} = "
                 f"{workload.per_device_batch} sequences per device")
    lines = (
        f"usable memory: {format_bytes(request.device_memory)} x (1 - {_num(request.headroom)} "
        f"headroom) = {format_bytes(request.usable)} per device",
        f"precision: {_PRECISION} (16-bit params and grads, f32 master and {request.optimizer} "
        f"state{_BOUND if OPTIMIZERS[request.optimizer] is None else ''})",
        batch,
    )
    if request.tensor > 1:
        t = request.tensor
        ranks = request.data * request.devices
        sp = ", the norm and dropout regions split along the sequence (sequence parallelism)"
        lines += (f"tensor parallel: each of the {ranks} data-parallel ranks is {t} "
                  f"devices ({ranks * t} in all), each holding 1/{t} of every layer"
                  f"{sp if request.sequence_parallel else ''}",)
    if request.context > 1:
        n = request.context
        lines += (f"context parallel: each sequence split over {n} devices of every rank (ring "
                  f"attention), each keeping 1/{n} of every layer's activations; model states "
                  "and the head and loss whole on each",)
    return lines


def _accumulation(request: _Request, choice: _Choice) -> int | None:
    """Micro-batches accumulated per step (None without a workload)."""
    if choice.micro_batch is None:
        return None
    return request.workload.per_device_batch // choice.micro_batch


def _conclusion(request: _Request, choice: _Choice) -> str:
    """Pass 5b: the explanation's last line when ``choice`` fits."""
    batch = ""
    accum = _accumulation(request, choice)
    if accum is not None:
        batch = (
            f", checkpointing={choice.checkpointing}, micro-batch {choice.micro_batch} x "
            f"{accum} accumulation step{'s' if accum > 1 else ''}"
        )
    tensor = f", tensor {request.tensor}" if request.tensor > 1 else ""
    tensor += f", context {request.context}" if request.context > 1 else ""
    return (
        f"-> plan: {choice.method.label}, mixed precision, {_STAGE_NAMES[choice.stage]}{tensor}"
        f"{batch}: "
        f"{format_bytes(choice.total_bytes)} of {format_bytes(request.usable)} usable per device"
    )


def _result(request: _Request, steps: list[str], choice: _Choice | None) -> Plan:
    """Pass 5c: the :class:`Plan` of ``choice``, or of no fit where ``choice`` is None."""
    chosen = dict.fromkeys(("zero_stage", "lora_fraction", "frozen_dtype", "checkpointing",
                            "micro_batch",
                            "grad_accum_steps", "states", "activation_bytes", "total_bytes"))
    if choice is not None:
        chosen = {
            "zero_stage": choice.stage,
            "lora_fraction": choice.method.lora_fraction,
            "frozen_dtype": (None if choice.method.lora_fraction is None
                             else choice.method.frozen_dtype),
            "checkpointing": choice.checkpointing,
            "micro_batch": choice.micro_batch,
            "grad_accum_steps": _accumulation(request, choice),
            "states": choice.states,
            "activation_bytes": choice.activation_bytes,
            "total_bytes": choice.total_bytes,
        }
    return Plan(
        fits=choice is not None,
        num_params=request.num_params,
        devices=request.devices,
        device_memory=request.device_memory,
        usable_bytes=request.usable,
        optimizer=request.optimizer,
        precision=_PRECISION,
        steps=tuple(steps),
        tensor=request.tensor,
        data=request.data,
        sequence_parallel=request.sequence_parallel,
        context=request.context,
        **chosen,
    )


def plan(
    num_params: int | str,
    *,
    devices: int,
    device_memory: str,
    # Grouped as the docstring's Args group them.
    layers: int | None = None, hidden: int | None = None, heads: int | None = None,
    seq_len: int | None = None, global_batch: int | None = None,
    optimizer: str = "adamw",
    allow_lora: bool = True,
    headroom: float = HEADROOM,
    lora_fraction: float = 0.01,
    dropout: bool = True,
    blockwise_attention: bool = False,
    kv_heads: int | None = None, head_dim: int | None = None, ffn: int | None = None,
    gated_mlp: bool = False, vocab: int | None = None, sandwich_norms: bool = False,
    tensor: int = 1,
    quantized_base: str | None = None, quantized_bytes: int | None = None,
    data: int = 1, sequence_parallel: bool = False, reference: bool = False,
    context: int = 1,
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
      devices: data-parallel devices (>= 1), the ones the ZeRO stages shard over (times
        ``data`` replicas of them, see ``data``).
      device_memory: memory per device with its unit, such as ``"80GB"`` or ``"80GiB"``
        (:func:`~effijax.memory.parse_bytes`; a bare number is refused).
      layers, hidden, heads, seq_len, global_batch: the model shape and the global batch in
        sequences; give all five or none (then only model states are planned).
        ``global_batch`` must divide by ``data x devices``.
      optimizer: one of :data:`~effijax.memory.OPTIMIZERS` (``effijax train``'s names);
        ``adafactor`` is counted at its bound, one state value per parameter.
      allow_lora: if False, LoRA is never proposed; a model that needs it does not fit.
      headroom: fraction of ``device_memory`` kept free, in [0, 1).
      lora_fraction: adapter parameters as a fraction of Ψ, in (0, 1].
      dropout: whether activations include dropout masks.
      blockwise_attention: whether attention is blockwise (flash), without s x s scores.
      kv_heads, head_dim, ffn, gated_mlp, vocab, sandwich_norms: the rest of a model's shape
        (grouped-query attention, a gated MLP, the logits, Gemma 3's extra norms), as
        :func:`activation_bytes` takes them; the
        defaults are Korthikanti et al.'s GPT layer without logits.
      tensor: a tensor-parallel degree: every data-parallel rank of ``devices`` is a group of
        ``tensor`` devices, each holding ``1/tensor`` of the model states
        (:func:`model_states`) and of the tensor-parallel activations
        (:func:`activation_bytes`); must divide ``heads``.
      quantized_base: ``"nf4"`` or ``"int8"``: when LoRA on a bf16 base does not fit, try it on
        a base stored so (QLoRA); None never proposes one.
      quantized_bytes: that base's exact bytes (:func:`~effijax.memory.frozen_base_bytes` of
        the model); None counts :data:`~effijax.memory.FROZEN_SCALE_BITS` per parameter.
      data: replicas of the ``devices`` group (hybrid sharding's outer axis, a mesh's ``data``):
        the global batch splits over ``data x devices`` ranks, the ZeRO stages shard over
        ``devices`` only. :func:`~effijax.memory.plan_mesh` searches it.
      sequence_parallel: with ``tensor``, count the activations with sequence parallelism
        (Korthikanti et al.'s ``34/t``).
      reference: the objective compares the policy with a reference model (DPO): full
        fine-tuning holds a bf16 copy of the weights, laid out as the parameters (LoRA's
        reference is the base with the adapters off: nothing more).
      context: a context-parallel degree: every rank's sequences are split over ``context``
        devices (ring attention), each keeping ``1/context`` of the layers' activations
        (:func:`activation_bytes`) and whole model states; ``2 x context`` must divide
        ``seq_len`` and ``dropout`` be False.

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
      >>> p = plan("30B", devices=2, device_memory="80GB", tensor=4, allow_lora=False)
      >>> p.fits, p.zero_stage, p.tensor
      (True, 2, 4)
      >>> print(p.explain().splitlines()[-2])  # doctest: +NORMALIZE_WHITESPACE
      full fine-tuning, ZeRO-2: model states (2 + 14/2)/4 B/param x 30e9 = 67.5 GB
      <= 72 GB usable
    """
    request = _check_request(
        num_params, devices=devices, device_memory=device_memory, optimizer=optimizer,
        headroom=headroom, allow_lora=allow_lora, lora_fraction=lora_fraction,
        shape={"layers": layers, "hidden": hidden, "heads": heads, "seq_len": seq_len,
               "global_batch": global_batch},
        layer_options={"dropout": dropout, "blockwise_attention": blockwise_attention,
                       "kv_heads": kv_heads, "head_dim": head_dim, "ffn": ffn,
                       "gated_mlp": gated_mlp, "sandwich_norms": sandwich_norms},
        vocab=vocab, tensor=tensor, quantized_base=quantized_base,
        quantized_bytes=quantized_bytes, data=data, sequence_parallel=sequence_parallel,
        reference=reference, context=context,
    )
    steps, why_not = list(_preamble(request)), []
    for method in _methods(request):
        outcome = _try_method(request, method)
        steps += outcome.steps
        if outcome.choice is not None:
            return _result(request, [*steps, _conclusion(request, outcome.choice)], outcome.choice)
        why_not.append(outcome.why_not)
    if request.lora_fraction is None:
        why_not.append("LoRA not tried (allow_lora=False)")
    steps.append("-> does not fit: " + "; ".join(why_not))
    return _result(request, steps, None)
