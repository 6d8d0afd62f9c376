"""Where a compiled step's time goes: a ``jax.profiler`` trace summed by kind of work.

A trace says which compiled op ran when (each device op carries its ``hlo_op`` and
``hlo_module``); the compiled program's HLO text says what each op is: its opcode, the ops a
fusion holds, the matmuls' shapes, and the Python stack each op was traced from (the text's
``StackFrames`` tables). :func:`step_breakdown` joins the two and sums each op's time, per
step, into one of :data:`CATEGORIES`, with the FLOPs of the matmuls it ran, so each row has its
achieved rate:

* ``collectives``: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute (and
  their asynchronous ``-start``/``-done`` halves), alone or inside a fusion;
* ``attention``, ``head and loss``, ``optimizer update``: by the innermost effijax function on
  the op's stack (the attention kernels of :mod:`effijax.models`, the output head and the
  cross-entropy, the step's update after its gradients), or by a ``jax.named_scope`` named
  ``attention``, ``head_and_loss`` or ``optimizer_update`` on the op's name, for code of your
  own;
* ``matmuls``: every other op that holds a dot (a fusion with one, a GEMM custom call);
* ``copies and layout``: ops that only move data (copies, transposes, slices and their
  updates, broadcasts, concatenations, gathers and scatters);
* ``norms and elementwise``: the rest (normalisation statistics, activations, casts, masks);
* ``unattributed``: the module's events whose op the text does not name (a GPU's command
  buffer, which runs many ops as one CUDA graph, is timed as a whole: profile with
  ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` to see its ops);
* ``idle``: the step's wall time when no op of it ran.

The FLOPs are counted from the HLO: ``2 * M * N * K`` for each dot (the PaLM convention: every
multiply-add twice, causal masks not discounted), times how often the trace ran it, so a layer
scan's body counts once per layer. Ops the text does not describe (a custom call other than a
GEMM, cuDNN's fused attention included) get their time and no FLOPs; their row says ``n/a``.

Times are sums of op durations: where ops overlap (two CPU threads, a GPU's copy and compute
streams), a step's rows add up to more than its wall time, and ``busy_s`` (the time at least
one op ran) is what ``idle`` is measured against.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

__all__ = ["CATEGORIES", "CategoryTime", "HloOp", "StepBreakdown", "hlo_ops", "step_breakdown"]

CATEGORIES = ("matmuls", "attention", "norms and elementwise", "copies and layout",
              "head and loss", "optimizer update", "collectives", "unattributed", "idle")

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast", "ragged-all-to-all")
# Ops that only move or lay out data (a fusion of nothing else is one too).
_MOVES = {"copy", "copy-start", "copy-done", "transpose", "dynamic-slice", "dynamic-update-slice",
          "slice", "broadcast", "concatenate", "pad", "reshape", "bitcast", "gather", "scatter",
          "reverse", "iota", "constant", "parameter", "tuple", "get-tuple-element",
          "bitcast-convert"}
# Ops that enclose others: the trace times their contents separately.
_ENCLOSING = {"while", "conditional", "call", "async-start", "async-update", "async-done"}
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__onednn$matmul")
_DIFFERENTIATED = re.compile(r'op_name="[^"]*(jvp|transpose)\(')  # inside value_and_grad
_SCOPES = {"attention": "attention", "head_and_loss": "head and loss",
           "optimizer_update": "optimizer update"}

# The innermost effijax function on an op's stack decides its kind (_frame_category): the
# files and functions below. None: the model's own work (a dot is a matmul, the rest
# elementwise or data movement). A generic helper (such as precision's ``dot``) passes the
# decision to its caller.
_ATTENTION_FILES = ("effijax/models/_blockwise.py", "effijax/models/_ring.py")
_MODEL_FILES = ("effijax/models/", "effijax/lora/")
_UPDATE_FILES = ("effijax/step.py", "effijax/optimizers.py", "effijax/precision/_loss_scale.py")


def _frame_category(path: str, function: str) -> str | None | bool:
    """The category an effijax frame decides, None for the model's own work, False where the
    frame decides nothing (not effijax's, or a generic helper)."""
    path = path.replace(os.sep, "/")
    if "effijax/" not in path:
        return False
    if path.endswith(_ATTENTION_FILES) or (
            path.endswith(("effijax/models/_attention.py", "effijax/models/_cache.py"))
            and ("attend" in function or "attention" in function.split(".")[-1])):
        return "attention"
    if path.endswith("effijax/models/_head.py") or (
            path.endswith("effijax/precision/_islands.py")
            and ("nll" in function or "entropy" in function)):
        return "head and loss"
    if path.endswith(_UPDATE_FILES):
        return "optimizer update"
    if path.endswith("effijax/precision/_islands.py"):
        return False  # dot, einsum, norm statistics: whoever called them decides
    if any(f in path for f in _MODEL_FILES):
        return None
    return False


class HloOp(NamedTuple):
    """One op of a compiled program: its opcode, its category (before its time is known) and
    the FLOPs of one execution (its dots), or None where the text does not say (a custom call
    that is not a GEMM)."""

    name: str
    opcode: str
    category: str
    flops: float | None


class CategoryTime(NamedTuple):
    """One row of a :class:`StepBreakdown`: seconds and FLOPs per step, op executions per
    step, and whether some of its ops had no FLOP count."""

    category: str
    seconds: float
    flops: float
    ops: float
    uncounted: bool = False

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds if self.seconds > 0 else 0.0


class StepBreakdown(NamedTuple):
    """What :func:`step_breakdown` returns: the step's wall time, the time some op of it ran,
    and one :class:`CategoryTime` per category that ran (``idle`` last)."""

    step_s: float
    busy_s: float
    rows: tuple[CategoryTime, ...]

    def row(self, category: str) -> CategoryTime:
        """The row of ``category`` (zeros where nothing of it ran)."""
        for r in self.rows:
            if r.category == category:
                return r
        if category not in CATEGORIES:
            raise KeyError(f"{category!r}: expected one of {CATEGORIES}")
        return CategoryTime(category, 0.0, 0.0, 0.0)

    def markdown(self, peak_flops: float | None = None) -> str:
        """The rows as a Markdown table: ms per step, share of the step's wall time, TFLOP/s
        achieved and, given ``peak_flops`` (FLOP/s), the fraction of that peak."""
        head = ["category", "ms per step", "share of step", "TFLOP/s"]
        if peak_flops:
            head.append("of peak")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            rate = ("n/a" if r.uncounted and not r.flops else
                    f"{r.flops_per_s / 1e12:.3g}" if r.flops else "")
            cells = [r.category, f"{1e3 * r.seconds:.3f}",
                     f"{r.seconds / self.step_s:.1%}" if self.step_s else ""]
            cells.append(rate)
            if peak_flops:
                cells.append(f"{r.flops_per_s / peak_flops:.2f}" if r.flops else "")
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The HLO text.

_SHAPE = re.compile(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_INSIDE = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")  # computations run inside an op
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


class _Instr(NamedTuple):
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


def _past_parens(text: str, i: int) -> int:
    """The index just past the parenthesis that closes the one at ``text[i]``."""
    depth = 0
    while i < len(text):
        depth += (text[i] == "(") - (text[i] == ")")
        i += 1
        if depth == 0:
            break
    return i


def _split_instruction(rest: str) -> tuple[str, str, str, str] | None:
    """``shape, opcode, operands, attributes`` of an instruction's right-hand side."""
    if not rest.strip():
        return None
    i = _past_parens(rest, 0) if rest.startswith("(") else len(rest.split(None, 1)[0])
    m = _OPCODE.match(rest, i)
    if m is None:
        return None
    end = _past_parens(rest, m.end() - 1)
    return rest[:i], m.group(1), rest[m.end():end - 1], rest[end:]


def _dims(shape: str) -> list[int] | None:
    m = _SHAPE.search(shape)
    if m is None:
        return None
    return [int(d) for d in m.group(2).split(",") if d]


def _operand_names(operands: str) -> list[str]:
    names = []
    for part in _split_top(operands):
        part = part.strip()
        m = re.search(r"%?([\w.\-]+)$", part)
        names.append(m.group(1) if m else part)
    return names


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def _parse(text: str) -> tuple[dict[str, list[_Instr]], list[str], dict[str, dict]]:
    """The text's computations (name -> instructions, the entry's name last in ``order``) and
    its tables (``FileNames``, ``FunctionNames``, ``FileLocations``, ``StackFrames``)."""
    computations: dict[str, list[_Instr]] = {}
    order: list[str] = []
    tables: dict[str, dict] = {}
    current: list[_Instr] | None = None
    table: dict | None = None
    entry = None
    for line in text.splitlines():
        if current is not None:
            if line.strip() == "}":
                current = None
                continue
            m = _INSTRUCTION.match(line)
            if m:
                parts = _split_instruction(m.group(2))
                if parts:
                    shape, opcode, operands, attrs = parts
                    current.append(_Instr(m.group(1), shape, opcode,
                                          _operand_names(operands), attrs))
            continue
        stripped = line.strip()
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = tables.setdefault(stripped, {})
            continue
        m = _COMPUTATION.match(line)
        if m:
            table = None
            current = computations.setdefault(m.group(2), [])
            order.append(m.group(2))
            if m.group(1):
                entry = m.group(2)
            continue
        if table is not None:
            r = _TABLE_ROW.match(stripped)
            if r:
                table[int(r.group(1))] = r.group(2)
            elif stripped:
                table = None
    if entry is not None:
        order.remove(entry)
        order.append(entry)
    return computations, order, tables


def _frames(tables: dict[str, dict]) -> dict[int, list[tuple[str, str]]]:
    """Each stack frame id -> its ``(file, function)`` chain, innermost first.

    XLA's printer writes each frame's parent id one higher than the id it means (the root
    frames name themselves); a text with no frame naming itself is read as written."""
    files = {k: v.strip().strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip().strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        fn = re.search(r"function_name_id=(\d+)", v)
        locations[k] = (files.get(int(f.group(1)), "") if f else "",
                        functions.get(int(fn.group(1)), "") if fn else "")
    raw = {}
    for k, v in tables.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        parent = re.search(r"parent_frame_id=(\d+)", v)
        raw[k] = (int(loc.group(1)) if loc else 0, int(parent.group(1)) if parent else 0)
    shifted = any(parent == k for k, (_, parent) in raw.items())
    chains: dict[int, list[tuple[str, str]]] = {}
    for k in raw:
        chain, seen, frame = [], set(), k
        while frame and frame in raw and frame not in seen:
            seen.add(frame)
            loc, parent = raw[frame]
            chain.append(locations.get(loc, ("", "")))
            frame = parent - 1 if shifted else parent
        chains[k] = chain
    return chains


_DOT_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
# A GEMM custom call's dot dimension numbers, in its backend config.
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]')


def _contraction_flops(instr: _Instr, shapes: Mapping[str, str],
                       contracting: re.Pattern) -> float | None:
    """``2 * (output elements) * (contracted size)`` of a dot or GEMM (whose output may be a
    ``(result, workspace)`` tuple: its first shape), the lhs's contracted dimensions read with
    ``contracting``."""
    out = _dims(instr.shape)
    lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else None
    m = contracting.search(instr.attrs)
    if out is None or lhs is None or m is None:
        return None
    dims = [int(d.strip().strip('"')) for d in m.group(1).split(",") if d.strip()]
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in dims)


def _matmul(i: _Instr, shapes: Mapping[str, str], stack) -> tuple[float | None, object] | None:
    """``(flops, the stack's decision or None)`` of a dot or a GEMM custom call; ``(None,
    False)`` for another custom call (work the text does not count); None for other ops."""
    decided = stack if stack is not False else None
    if i.opcode == "dot":
        return _contraction_flops(i, shapes, _DOT_CONTRACTING), decided
    if i.opcode == "convolution":
        return None, decided
    if i.opcode == "custom-call":
        target = _TARGET.search(i.attrs)
        if target and target.group(1).startswith(_GEMM_TARGETS):
            return _contraction_flops(i, shapes, _GEMM_CONTRACTING), decided
        return None, False
    return None


def _scope(attrs: str) -> str | None:
    m = re.search(r'op_name="([^"]*)"', attrs)
    if not m:
        return None
    for token in re.split(r"[/()]", m.group(1)):
        if token in _SCOPES:
            return _SCOPES[token]
    return None


def _stack_category(attrs: str, chains: Mapping[int, list[tuple[str, str]]]) -> str | None | bool:
    scoped = _scope(attrs)
    if scoped:
        return scoped
    m = re.search(r"stack_frame_id=(\d+)", attrs)
    for path, function in chains.get(int(m.group(1)), []) if m else []:
        decided = _frame_category(path, function)
        if decided == "optimizer update" and _DIFFERENTIATED.search(attrs):
            return None  # the step's own forward or backward work (the parameters' cast)
        if decided is not False:
            return decided
    return False


class _Contents(NamedTuple):
    flops: float | None
    dot_category: str | None | bool  # the stack's decision for the first dot, False: no dot
    collective: bool
    moves_only: bool
    decided: str | None | bool  # the first decisive stack among the contents


def _summarize(instrs: list[_Instr], shapes: Mapping[str, str],
               computations: Mapping[str, list[_Instr]],
               chains: Mapping[int, list[tuple[str, str]]], memo: dict) -> _Contents:
    """What ``instrs`` hold together (a fusion's contents counted in): their dots' FLOPs, the
    first dot's kind, whether a collective is among them, whether they only move data, and the
    first kind a stack decides."""
    flops: float | None = 0.0
    dot_category: str | None | bool = False
    collective, moves_only, decided = False, True, False
    for i in instrs:
        inner = None
        called = _CALLS.search(i.attrs)
        if i.opcode == "fusion" and called:
            inner = _contents(called.group(1), computations, chains, memo)
        stack = _stack_category(i.attrs, chains)
        if decided is False and stack is not False:
            decided = stack
        matmul = _matmul(i, shapes, stack)
        if matmul is not None:
            f, category = matmul
            flops = None if flops is None or f is None else flops + f
            if dot_category is False:
                dot_category = category
        if i.opcode.startswith(_COLLECTIVES):
            collective = True
        if inner is not None:
            flops = None if flops is None or inner.flops is None else flops + inner.flops
            if dot_category is False:
                dot_category = inner.dot_category
            collective |= inner.collective
            moves_only &= inner.moves_only
            if decided is False:
                decided = inner.decided
        elif i.opcode not in _MOVES:
            moves_only = False
    return _Contents(flops, dot_category, collective, moves_only, decided)


def _contents(comp: str, computations: Mapping[str, list[_Instr]],
              chains: Mapping[int, list[tuple[str, str]]], memo: dict) -> _Contents:
    """:func:`_summarize` of a called computation, once per computation."""
    if comp not in memo:
        memo[comp] = _Contents(0.0, False, False, True, False)  # a cycle counts nothing twice
        instrs = computations.get(comp, [])
        memo[comp] = _summarize(instrs, {i.name: i.shape for i in instrs}, computations,
                                chains, memo)
    return memo[comp]


def hlo_ops(hlo_text: str) -> dict[str, HloOp]:
    """Every op of a compiled program's HLO text (``jax.jit(f).lower(...).compile().as_text()``)
    that a trace can time, by name: its opcode, its category and the FLOPs of one execution.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> text = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(
      ...     jnp.ones((8, 16)), jnp.ones((16, 4))).compile().as_text()
      >>> dots = [op for op in hlo_ops(text).values() if op.category == "matmuls"]
      >>> sum(op.flops for op in dots)  # 2 * 8 * 4 * 16
      1024.0
    """
    computations, order, tables = _parse(hlo_text)
    chains = _frames(tables)
    memo: dict = {}
    ops: dict[str, HloOp] = {}
    # A fusion's computation and a reduction's scalar one run inside their op, not as ops.
    inside = {m.group(1) for instrs in computations.values() for i in instrs
              for m in _INSIDE.finditer(i.attrs)}
    for comp in order:
        if comp in inside:
            continue
        instrs = computations[comp]
        shapes = {i.name: i.shape for i in instrs}
        for i in instrs:
            if i.opcode in ("parameter", "constant", "tuple", "get-tuple-element"):
                continue
            c = _summarize([i], shapes, computations, chains, memo)
            flops = c.flops
            if i.opcode in _ENCLOSING:
                category, flops = "enclosing", 0.0
            elif c.collective:
                category, flops = "collectives", 0.0
            elif c.dot_category is not False:
                category = c.dot_category or "matmuls"
            elif c.decided not in (False, None):
                category = c.decided
            elif c.moves_only:
                category = "copies and layout"
            elif i.opcode == "custom-call" and c.decided is False and "fmha" in i.attrs:
                category = "attention"
            else:
                category = "norms and elementwise"
            ops[i.name] = HloOp(i.name, i.opcode, category, flops)
    return ops


# ---------------------------------------------------------------------------------------------
# The trace.


def _events(trace) -> list[dict]:
    if isinstance(trace, (str, os.PathLike)):
        raw = Path(trace).read_bytes()
        trace = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return trace["traceEvents"] if isinstance(trace, Mapping) else list(trace)


def _module_name(hlo_text: str) -> str:
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    if m is None:
        raise ValueError("hlo_text: expected a compiled program's HLO text (starting with "
                         "'HloModule NAME'), e.g. jax.jit(f).lower(*args).compile().as_text()")
    return m.group(1)


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_breakdown(trace, hlo_text: str, steps: int, *,
                   step_s: float | None = None) -> StepBreakdown:
    """The time of a compiled step by kind of work, from a trace of ``steps`` runs of it.

    Args:
      trace: the trace's events: a ``*.trace.json.gz`` (or ``perfetto_trace.json.gz``) file
        that ``jax.profiler.trace(dir, create_perfetto_trace=True)`` wrote, or its loaded
        JSON.
      hlo_text: the step's compiled HLO, ``jitted.lower(*args).compile().as_text()``; only
        the trace's ops of this module (``HloModule NAME``) are counted.
      steps: how many times the step ran inside the trace.
      step_s: the step's wall time, measured; default: the span from the first op of the
        module to its last, over ``steps``.

    Returns:
      A :class:`StepBreakdown`: per step and per device (a sharded program's ops run on each
      of its devices; each device's share is averaged), each category's seconds, FLOPs and
      op executions (categories that ran, in :data:`CATEGORIES` order, ``idle`` last).

    Raises:
      ValueError: the trace holds no op of this module (another program traced, a trace of
        nothing, or a backend whose trace names no HLO ops), or ``steps`` < 1.

    Example:
      >>> import glob, tempfile, jax, jax.numpy as jnp
      >>> f = jax.jit(lambda a, b: jnp.tanh(a @ b))
      >>> a, b = jnp.ones((64, 64)), jnp.ones((64, 64))
      >>> compiled = f.lower(a, b).compile()
      >>> _ = jax.block_until_ready(compiled(a, b))
      >>> with tempfile.TemporaryDirectory() as d:
      ...     with jax.profiler.trace(d, create_perfetto_trace=True):
      ...         for _ in range(3):
      ...             _ = jax.block_until_ready(compiled(a, b))
      ...     (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
      ...     got = step_breakdown(path, compiled.as_text(), steps=3)
      >>> got.row("matmuls").flops  # 2 * 64**3 per step
      524288.0
      >>> got.row("norms and elementwise").ops  # the tanh
      1.0
    """
    if steps < 1:
        raise ValueError(f"steps={steps}: expected the number of steps traced, >= 1")
    module = _module_name(hlo_text)
    ops = hlo_ops(hlo_text)
    events = _events(trace)
    names = {e.get("pid"): (e.get("args") or {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    mine = [e for e in events if e.get("ph") == "X" and (e.get("args") or {}).get(
        "hlo_module") == module and "hlo_op" in e["args"]]
    on_devices = [e for e in mine if str(names.get(e.get("pid"), "")).startswith("/device:")]
    mine = on_devices or mine  # a GPU's kernels, not the host's launches of them
    unnamed = HloOp("", "", "unattributed", None)
    leaves = [e for e in mine if ops.get(e["args"]["hlo_op"], unnamed).category != "enclosing"]
    if not leaves:
        raise ValueError(f"the trace holds no op of {module!r}: trace the compiled program "
                         "whose text this is (and a backend whose trace names its HLO ops)")
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    flops = dict.fromkeys(CATEGORIES, 0.0)
    count = dict.fromkeys(CATEGORIES, 0)
    uncounted = dict.fromkeys(CATEGORIES, False)
    for e in leaves:
        op = ops.get(e["args"]["hlo_op"], unnamed)
        seconds[op.category] += float(e.get("dur", 0.0)) / 1e6
        count[op.category] += 1
        if op.flops is None:
            uncounted[op.category] = True
        else:
            flops[op.category] += op.flops
    # Per device: a sharded program runs its ops on each (the same shapes, SPMD).
    per_device: dict[tuple, list[tuple[float, float]]] = {}
    for e in leaves:
        start = float(e["ts"])
        per_device.setdefault((e.get("pid"), e["args"].get("device_ordinal")), []).append(
            (start, start + float(e.get("dur", 0.0))))
    n = len(per_device) * steps
    busy = sum(_union(spans) for spans in per_device.values()) / 1e6 / n
    if step_s is None:
        step_s = sum(max(b for _, b in spans) - min(a for a, _ in spans)
                     for spans in per_device.values()) / 1e6 / n
    rows = [CategoryTime(c, seconds[c] / n, flops[c] / n, count[c] / n, uncounted[c])
            for c in CATEGORIES if count[c]]
    rows.append(CategoryTime("idle", max(0.0, step_s - busy), 0.0, 0.0))
    return StepBreakdown(step_s, busy, tuple(rows))
