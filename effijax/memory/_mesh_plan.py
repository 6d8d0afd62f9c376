"""The mesh search: which ``(data, fsdp, tensor)`` mesh to train on, and with what.

:func:`plan` plans one mesh: the cheapest ZeRO stage, checkpointing, micro-batch and method
that fit. :func:`plan_mesh` runs it on every factorisation ``data x fsdp x tensor`` of the
device count and ranks what fits by one rule, in this order:

1. fits in ``(1 - headroom)`` of device memory;
2. full fine-tuning before LoRA before QLoRA (a change of method is not traded for traffic);
3. no recomputation before block checkpointing (about one extra forward pass);
4. least communication per device per step (:func:`communication`: tensor-parallel
   all-reduces, or all-gathers and reduce-scatters, of the activations, and the data-parallel
   gradient sync; every micro-batch of an accumulated step sends its own);
5. least memory per device; then the smaller context degree, the smaller tensor degree and
   the larger ``fsdp``.

The tensor degree must divide the query heads, the MLP width and the vocabulary (the facts
:func:`effijax.sharding.tensor_split` refuses a mesh on; key/value heads are replicated where
it does not divide them), and stay within one node when ``node_size`` is known: its
all-reduces sit on every layer's critical path. Without the model's shape the tensor traffic
cannot be counted, so the search then keeps ``tensor=1`` unless ``tensor`` pins it.

A ``context`` axis (context parallelism, ring attention) is what fits a sequence whose
activations no other split brings under the memory: each device keeps ``1/context`` of every
layer's activations, while model states stay as the ``fsdp`` axis shards them (nothing is
split over ``context``; its devices synchronise gradients as data-parallel replicas do). Its
traffic is the ring's, per layer and micro-batch: ``context - 1`` hops of a K/V shard forward,
and in the backward pass as many again with ``context`` hops of their f32 gradients
(:func:`_ring_wire`). The search tries it when asked: ``context=None`` searches the degrees
whose ``2 x context`` chunks split the sequence (the model without dropout); an int pins it;
the default, 1, plans meshes without one.
"""

from __future__ import annotations

import dataclasses
import math

from effijax.errors import ConfigError, whole_number
from effijax.memory._activations import _check_context
from effijax.memory._communication import communication
from effijax.memory._estimate import _check_num_params, format_bytes
from effijax.memory._plan import Plan, plan
from effijax.sharding import TensorLayout, tensor_split

__all__ = ["Candidate", "MeshPlan", "RULE", "plan_mesh"]

RULE = ("fits in memory, then full fine-tuning before LoRA before QLoRA, then no recomputation "
        "before block checkpointing, then least communication per step, then least memory per "
        "device")
_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")  # by ZeRO stage: effijax train's --strategy


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One mesh and the cheapest configuration :func:`plan` found for it.

    Attributes:
      data, fsdp, tensor: the mesh's axis sizes.
      plan: :func:`plan`'s result on this mesh (``devices=fsdp``, ``data=data``).
      communication: bytes one device sends per step (None when nothing fits).
      tensor_wire_bytes: of which over the ``tensor`` axis (None when nothing fits, or without
        the model's shape, when it is not counted).
      context: the mesh's ``context`` axis (1: none).
      context_wire_bytes: of the communication, the ring attention's over ``context`` (None
        when nothing fits; 0 without a context axis).
    """

    data: int
    fsdp: int
    tensor: int
    plan: Plan
    communication: float | None
    tensor_wire_bytes: float | None
    context: int = 1
    context_wire_bytes: float | None = None

    @property
    def mesh(self) -> str:
        """The mesh as ``effijax train --mesh`` takes it: ``data=1,fsdp=2,tensor=4``, with
        ``context=N`` before ``tensor`` when there is a context axis."""
        context = f"context={self.context}," if self.context > 1 else ""
        return f"data={self.data},fsdp={self.fsdp},{context}tensor={self.tensor}"

    @property
    def strategy(self) -> str | None:
        """``effijax train --strategy``: ddp, zero1, zero2 or fsdp (None when nothing fits)."""
        stage = self.plan.zero_stage
        return None if stage is None else _STRATEGIES[stage]

    def row(self, width: int = 24) -> str:
        """One line of the candidates' table (the mesh in a column ``width`` wide)."""
        p = self.plan
        if not p.fits:
            return f"  {self.mesh:<{width}} {'-':<34} {'-':>10} {'-':>10}  no"
        how = self.strategy
        if p.lora:
            how += " QLoRA" if p.frozen_dtype != "bf16" else " LoRA"
        if p.checkpointing == "block":
            how += f" +ckpt mb {p.micro_batch}x{p.grad_accum_steps}"
        return (f"  {self.mesh:<{width}} {how:<34} {format_bytes(p.total_bytes):>10} "
                f"{format_bytes(round(self.communication)):>10}  yes")


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The meshes compared and the one picked.

    Attributes:
      devices: devices in all.
      candidates: every mesh tried, best first (by :data:`RULE`; those that do not fit last).
      pick: the first candidate if it fits, else None.
      notes: what the search left out and why (tensor degrees that do not divide the model, or
        exceed a node; tensor traffic not counted without the model's shape).
    """

    devices: int
    candidates: tuple[Candidate, ...]
    pick: Candidate | None
    notes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        """Whether some mesh fits."""
        return self.pick is not None

    def table(self) -> str:
        """The candidates, one per line, under a header, and the rule that ranked them."""
        width = max(24, *(len(c.mesh) for c in self.candidates))
        head = (f"  {'mesh':<{width}} {'strategy':<34} {'memory':>10} {'comm/step':>10}  fits")
        return "\n".join([f"mesh search over {self.devices} devices (per device; rule: {RULE}):",
                          *(f"  note: {n}" for n in self.notes), head,
                          *(c.row(width) for c in self.candidates)])

    def explain(self) -> str:
        """The table, the pick as ``effijax train`` flags, and the pick's arithmetic (or the
        arithmetic of the pure-``fsdp`` mesh when nothing fits)."""
        # Ranked first: the pick, or when nothing fits the least split by tensor, most by fsdp.
        shown = self.candidates[0]
        flags = ("-> mesh: nothing fits" if self.pick is None else
                 f"-> mesh: --mesh {self.pick.mesh} --strategy {self.pick.strategy}")
        return "\n".join([self.table(), flags, shown.plan.explain()])


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, smallest first.

    Example:
      >>> _divisors(8)
      [1, 2, 4, 8]
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _tensor_degrees(devices: int, tensor, node_size, shape: dict) -> tuple[list[int], list[str]]:
    """The tensor degrees to try, and a note for each left out."""
    sizes = {"heads": shape["heads"], "kv": shape["kv_heads"] or shape["heads"],
             "mlp": shape["ffn"] or (4 * shape["hidden"] if shape["hidden"] else None),
             "vocab": shape["vocab"]}
    layout = TensorLayout(dims=(), sizes={k: v for k, v in sizes.items() if v is not None},
                          model="the model")
    if tensor is not None:
        tensor = whole_number("tensor", tensor, maximum=None)
        if devices % tensor:
            raise ConfigError("tensor", tensor, f"does not divide the {devices} devices (they "
                              f"are counted in all: for {devices} groups of {tensor} devices, "
                              f"give {devices * tensor})")
        tensor_split(layout, tensor)  # refuses a degree the model's widths do not take
        unknown = tensor > 1 and shape["layers"] is None
        return [tensor], ["tensor traffic not counted without the model's shape (the same on "
                          "every mesh here: one tensor degree)"] if unknown else []
    if shape["heads"] is None:
        return [1], ["tensor=1 only: the tensor traffic needs the model's shape (layers, "
                     "hidden, heads, seq_len, global_batch); or pin tensor"]
    kept, notes = [], []
    for t in _divisors(devices):
        if node_size is not None and t > node_size:
            notes.append(f"tensor={t} left out: more than a node's {node_size} devices")
            continue
        try:
            tensor_split(layout, t)
        except ConfigError as e:
            notes.append(f"tensor={t} left out: {e.problem.split('; use')[0]}")
            continue
        kept.append(t)
    return kept, notes


def _context_degrees(devices: int, context, shape: dict,
                     dropout: bool) -> tuple[list[int], list[str]]:
    """The context degrees to try (1 first), and a note for each left out."""
    if context is not None:
        context = whole_number("context", context, maximum=None)
        if devices % context:
            raise ConfigError("context", context, f"does not divide the {devices} devices")
        return [context], []
    if shape["seq_len"] is None:
        return [1], ["context=1 only: the context axis splits the activations, which need the "
                     "model's shape (layers, hidden, heads, seq_len, global_batch); or pin "
                     "context"]
    kept, notes = [], []
    for c in _divisors(devices):
        try:
            _check_context(c, shape["seq_len"], dropout)
        except ConfigError as e:
            notes.append(f"context={c} left out: {e}")
            continue
        kept.append(c)
    return kept, notes


def _ring_wire(shape: dict, options: dict, context: int, tensor: int, micro: int,
               checkpointing: str) -> float:
    """Bytes a device sends per micro-batch for ring attention over ``context`` devices.

    Per layer, with ``k`` the key/value width (``kv_heads x head_dim``, split over the tensor
    degree where it divides the key/value heads) and ``s/n`` the positions a device holds:
    the forward passes its K/V shard ``n - 1`` times (``2·p·(s/n)·b·k`` bytes, bf16), the
    backward passes it ``n - 1`` times again and the f32 ``dK, dV`` ``n`` times
    (``2·4·(s/n)·b·k``, the last hop bringing them home); block checkpointing repeats the
    forward's hops.

    Example:
      >>> # 8 layers, 8 kv heads of 128, 4096 positions over context=4, one sequence: shards
      >>> # of 1024 x 1024 values; per layer 3 x 2 x 2 + 3 x 2 x 2 + 4 x 2 x 4 = 56 bytes each.
      >>> _ring_wire({"layers": 8, "hidden": 4096, "heads": 32, "seq_len": 4096,
      ...             "kv_heads": 8}, {"head_dim": 128}, 4, 1, 1, "none") == 8 * 56 * 1024**2
      True
    """
    n = context
    if n == 1:
        return 0.0
    heads, kv_heads = shape["heads"], shape["kv_heads"] or shape["heads"]
    head_dim = options.get("head_dim") or shape["hidden"] // heads
    k = kv_heads * head_dim // (tensor if kv_heads % tensor == 0 else 1)
    local = shape["seq_len"] // n * micro * k  # key (or value) values of one shard
    hops = (n - 1) * (2 if checkpointing == "block" else 1)  # the forward's
    per_layer = hops * 2 * 2 * local + (n - 1) * 2 * 2 * local + n * 2 * 4 * local
    return float(shape["layers"] * per_layer)


def _traffic(p: Plan, num_params: int, data: int, shape: dict, options: dict,
             frozen_bytes: int | None) -> tuple[float, float | None, float]:
    """Bytes a device sends per step for ``p``'s configuration: (all, over ``tensor``, over
    ``context``). A context axis' devices synchronise gradients as data-parallel replicas."""
    stage, t, micro, n = p.zero_stage, p.tensor, p.micro_batch, p.context
    counted = shape["layers"] is not None
    # Without a shape only the gradient sync is counted (tensor=1, or one pinned tensor
    # degree shared by every candidate); the activation sizes are then placeholders.
    dims = ({"layers": shape["layers"], "hidden": shape["hidden"],
             "seq_len": shape["seq_len"] // n, "batch_size": micro} if counted else
            {"layers": 1, "hidden": 1, "seq_len": 1, "batch_size": 1})
    common = {**dims, "data": data * n, "fsdp": p.devices, "tensor": t,
              "sequence_parallel": p.sequence_parallel,
              "checkpointing": p.checkpointing or "none"}
    if not p.lora:
        c = communication(num_params, zero_stage=stage, **common)
        sync = c.grad_sync_wire_bytes
    else:
        # Only the adapters have gradients to synchronise; ZeRO-3 also gathers the frozen base
        # for the forward and the backward pass: two of the three parts of its 3Ψ, counted
        # over the base's bytes.
        c = communication(max(1, round(p.lora_fraction * num_params)), zero_stage=stage,
                          **common)
        sync = c.grad_sync_wire_bytes
        if stage == 3:
            base = frozen_bytes if p.frozen_dtype != "bf16" and frozen_bytes else 2 * num_params
            sync += communication(base, zero_stage=3, grad_bytes=1,
                                  **common).grad_sync_wire_bytes * 2 / 3
    steps = p.grad_accum_steps or 1
    tensor_wire = c.tensor_wire_bytes if counted else None
    ring = steps * _ring_wire(shape, options, n, t, micro, p.checkpointing) if n > 1 else 0.0
    return (steps * ((tensor_wire or 0.0) + sync) + ring,
            None if tensor_wire is None else steps * tensor_wire, ring)


def _rank(c: Candidate) -> tuple:
    p = c.plan
    if not p.fits:
        return (1, c.context, c.tensor, -c.fsdp)
    method = 0 if not p.lora else 1 if p.frozen_dtype == "bf16" else 2
    return (0, method, p.checkpointing == "block", c.communication, p.total_bytes, c.context,
            c.tensor, -c.fsdp)


def plan_mesh(
    num_params: int | str,
    *,
    devices: int,
    device_memory: str,
    layers: int | None = None, hidden: int | None = None, heads: int | None = None,
    seq_len: int | None = None, global_batch: int | None = None,
    kv_heads: int | None = None, ffn: int | None = None, vocab: int | None = None,
    tensor: int | None = None,
    node_size: int | None = None,
    sequence_parallel: bool = False,
    context: int | None = 1,
    **options,
) -> MeshPlan:
    """Plans every ``(data, fsdp, tensor)`` mesh of ``devices`` and picks one by :data:`RULE`.

    Each mesh gets :func:`plan`'s cheapest configuration (``devices=fsdp``, ``data=data``,
    ``tensor=tensor``) and its communication per step (:func:`communication`); a mesh whose
    cheapest configuration is DDP is listed once, as ``data=N,fsdp=1`` (DDP shards nothing
    over ``fsdp``). The ranking rule is in the module docstring.

    Args:
      num_params: Ψ, an int or a string like ``"70B"``.
      devices: devices in all (data x fsdp x tensor).
      device_memory: memory per device with its unit, e.g. ``"80GB"``.
      layers, hidden, heads, seq_len, global_batch: the model shape and the global batch, all
        five or none; without them the search keeps ``tensor=1`` (or the pinned ``tensor``).
      kv_heads, ffn, vocab: the widths the tensor degree must divide (default: ``heads``,
        ``4 x hidden``, not checked); also counted in the activations, as :func:`plan` does.
      tensor: pin the tensor degree (must divide ``devices``); None searches its divisors.
      node_size: devices per node: the tensor degree stays within one node; None: any.
      sequence_parallel: count tensor-parallel activations with sequence parallelism.
      context: the context-parallel degree (a ``context`` axis, must divide ``devices``);
        None searches the divisors of ``devices`` whose ``2 x context`` chunks split
        ``seq_len`` (given a shape, without dropout: ``dropout=False``), meshes whose
        ``data x fsdp`` the global batch does not split left out; 1 (the default): no
        context axis.
      **options: the rest of :func:`plan`'s keyword arguments (optimizer, allow_lora,
        headroom, lora_fraction, dropout, blockwise_attention, head_dim, gated_mlp,
        sandwich_norms, quantized_base, quantized_bytes).

    Returns:
      A :class:`MeshPlan`; ``pick`` is None when no mesh fits (no exception).

    Raises:
      ConfigError: naming the argument: a bad value, a pinned ``tensor`` that does not divide
        ``devices`` or the model's widths, a ``global_batch`` that does not divide over the
        devices (over ``devices / tensor`` when ``tensor`` is pinned).

    Example:
      >>> m = plan_mesh("1B", devices=8, device_memory="80GB", layers=16, hidden=2048,
      ...               heads=16, seq_len=2048, global_batch=32)
      >>> m.pick.mesh, m.pick.strategy, m.pick.communication  # 2 x 7/8 x 2 bytes x 1e9
      ('data=8,fsdp=1,tensor=1', 'ddp', 3500000000.0)
      >>> # 70B at 32k tokens, sequence-parallel: only tensor=8 keeps LoRA's activations small.
      >>> m = plan_mesh("70B", devices=8, device_memory="80GB", layers=80, hidden=8192,
      ...               heads=64, seq_len=32768, global_batch=8, sequence_parallel=True)
      >>> [c.mesh for c in m.candidates if c.plan.fits]
      ['data=1,fsdp=1,tensor=8']
      >>> m.pick.strategy, m.pick.plan.lora, m.pick.plan.grad_accum_steps
      ('ddp', True, 8)
      >>> # 1B at a million tokens a sequence: no mesh of 8 x 80 GB without a context axis fits.
      >>> long = dict(layers=16, hidden=2048, heads=16, seq_len=2**20, global_batch=8,
      ...             vocab=32000, dropout=False, blockwise_attention=True)
      >>> plan_mesh("1B", devices=8, device_memory="80GB", tensor=1, **long).fits
      False
      >>> m = plan_mesh("1B", devices=8, device_memory="80GB", tensor=1, context=None, **long)
      >>> m.pick.mesh, m.pick.plan.checkpointing, m.pick.plan.grad_accum_steps
      ('data=2,fsdp=1,context=4,tensor=1', 'block', 4)
    """
    num_params = _check_num_params(num_params)
    devices = whole_number("devices", devices, maximum=None)
    if node_size is not None:
        whole_number("node_size", node_size, maximum=None)
    shape = {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": seq_len,
             "global_batch": global_batch, "kv_heads": kv_heads, "ffn": ffn, "vocab": vocab}
    degrees, notes = _tensor_degrees(devices, tensor, node_size, shape)
    contexts, context_notes = _context_degrees(devices, context, shape,
                                               options.get("dropout", True))
    notes += context_notes
    pairs = [(t, c) for t in degrees for c in contexts if (devices // t) % c == 0]
    if not pairs:
        raise ConfigError("context", context, f"tensor={degrees[0]} x context={context} does "
                          f"not divide the {devices} devices")
    # Every mesh compared takes the same global batch: it must split over the data-parallel
    # ranks of each (all the devices when tensor is searched, as tensor=1 has them). With the
    # context degree searched, over those of one mesh at least; the meshes it does not split
    # are left out below.
    ranks = min(devices // t // c for t, c in pairs) if context is None else (
        devices // degrees[0] // contexts[0])
    if global_batch is not None and whole_number("global_batch", global_batch) % ranks:
        raise ConfigError("global_batch", global_batch, f"does not divide evenly over {ranks} "
                          f"devices; use a multiple of {ranks}")
    if sequence_parallel and degrees == [1]:
        notes.append("sequence_parallel has no effect at tensor=1")
    candidates, unsplit = [], []
    for t, c in pairs:
        if global_batch is not None and global_batch % (devices // t // c):
            unsplit.append(f"context={c}" + (f",tensor={t}" if t > 1 else ""))
            continue
        for f in reversed(_divisors(devices // t // c)):
            d = devices // t // c // f
            p = plan(num_params, devices=f, data=d, tensor=t, device_memory=device_memory,
                     sequence_parallel=sequence_parallel, context=c, **shape, **options)
            if p.fits and p.zero_stage == 0 and f > 1:
                continue  # the same as data=d*f,fsdp=1: DDP shards nothing over fsdp
            wire, tensor_wire, ring = (None, None, None) if not p.fits else _traffic(
                p, num_params, d, shape, options, options.get("quantized_bytes"))
            candidates.append(Candidate(d, f, t, p, wire, tensor_wire, c, ring))
    if unsplit:
        notes.append(f"{', '.join(unsplit)} left out: the global batch of {global_batch} does "
                     "not split over their data x fsdp ranks")
    candidates.sort(key=_rank)
    pick = candidates[0] if candidates[0].plan.fits else None
    return MeshPlan(devices, tuple(candidates), pick, tuple(notes))

