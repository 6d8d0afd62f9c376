"""``effijax memory`` and ``effijax plan``: the analytic memory estimate and the planner.

``effijax memory --params 7B --strategy fsdp --devices 8`` prints per-device bytes of
parameters, gradients, optimizer state (and activations, given a model shape); ``effijax plan
--params 70B --devices 8 --device-memory 80GB`` compares every ``(data, fsdp, tensor)`` mesh
of the devices, prints the table, the mesh it picks (as ``effijax train`` flags) and that
configuration's arithmetic.
Both take ``--json``. GB is 10**9 bytes. Bad flags exit with code 2 and a message on stderr
naming the flag, the value and the fix.

The settings ``effijax train`` also has speak its vocabulary, with its defaults (read from
:class:`~effijax.recipe.TrainConfig`): ``--strategy`` (ddp, zero1, zero2, fsdp; zero3 = fsdp;
default ddp, nothing sharded, as train runs without one), ``--optimizer`` (train's optimizers,
default adamw) and ``--precision`` (default ``auto``: there is no device to look at, so auto is
what train picks on a GPU or TPU, bf16, and the table says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from effijax.cli import _compiled_memory as _compiled
from effijax.cli import _from
from effijax.errors import NO_VALUE, ConfigError, whole_number
from effijax.memory import (
    CHECKPOINTING,
    FROZEN_DTYPES,
    FROZEN_SCALE_BITS,
    OPTIMIZERS,
    PRECISION_ALIASES,
    RULE,
    activation_bytes,
    format_bytes,
    model_states,
    parse_bytes,
    parse_count,
    plan_mesh,
)
from effijax.precision import PRESET_COMPUTE, auto_precision
from effijax.recipe import PRECISIONS, TrainConfig, holds_reference
from effijax.sharding import get_strategy

__all__ = ["add_parsers", "memory_command", "plan_command"]

_SHAPE_FLAGS = ("layers", "hidden", "heads", "seq_len")
# effijax train's settings, the one source of the names and defaults memory and plan share.
_TRAIN = {f.name: f for f in dataclasses.fields(TrainConfig)}
# The backend memory and plan count for when --precision is auto: an accelerator's.
_AUTO_BACKEND = "gpu"
# effijax.models.ATTENTION's names, spelled here so that --params runs never import JAX (a test
# checks they are the same).
_ATTENTION = ("auto", "naive", "blockwise", "xla")


def _argtype(parse, what: str):
    def convert(text: str):
        try:
            return parse(text)
        except ConfigError as e:
            # argparse already names the flag ("argument --params: "); add the value and problem.
            raise argparse.ArgumentTypeError(f"{text!r}: {e.problem}") from None

    convert.__name__ = what  # argparse names the type in "invalid <name> value" messages
    return convert


def _size(text: str) -> str:
    """A size with its unit, checked here and passed on as written (the library parses it)."""
    parse_bytes(text, field="device_memory")
    return text


# A count: not a number is argparse's "invalid int value"; 0, a negative or more than int32 is
# whole_number's message.
_count = _argtype(lambda text: whole_number("count", int(text)), "int")


def _context_degree(text: str) -> int | None:
    """``plan --context``: a degree, or ``search`` (None: the planner tries every one)."""
    return None if text.strip().lower() == "search" else _count(text)


_context_degree.__name__ = "int or 'search'"


def _number(text: str, inside, interval: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not inside(value):
        raise argparse.ArgumentTypeError(f"must be in {interval}, got {text}")
    return value


def _fraction(text: str) -> float:
    return _number(text, lambda value: 0 < value <= 1, "(0, 1]")


def _headroom(text: str) -> float:
    return _number(text, lambda value: 0 <= value < 1, "[0, 1)")


def _beta(text: str) -> float:
    return _number(text, lambda value: 0 <= value < float("inf"), "[0, inf)")


def _precision(text: str) -> str:
    """The canonical name of an alias ("mixed" -> "bf16"); model_states rejects unknown names."""
    key = text.strip().lower()
    return PRECISION_ALIASES.get(key, key)


def _strategy(text: str) -> str:
    """effijax train's strategy name (``zero3`` -> ``fsdp``); an unknown one is refused with
    the accepted names."""
    return get_strategy(text).name


def _zero_stage(strategy: str | None) -> int:
    """The ZeRO stage of a strategy: how many of optimizer state, gradients and parameters it
    shards (ddp 0, zero1 1, zero2 2, fsdp 3), read from the strategy itself."""
    s = get_strategy(strategy or "ddp")
    return int(s.shard_opt_state) + int(s.shard_grads) + int(s.shard_params)


def _resolve_precision(args: argparse.Namespace) -> None:
    """``--precision auto`` decided as effijax train decides it on a GPU or TPU (bf16), with
    the words it printed kept for the table (``args.precision_why``)."""
    args.precision_why = None
    if args.precision == "auto":
        auto = auto_precision(_AUTO_BACKEND, args.hidden or 0)
        args.precision = auto.precision
        args.precision_why = "auto: what effijax train picks on a GPU or TPU"
    _resolve_frozen(args, args.precision)


def _resolve_frozen(args: argparse.Namespace, precision: str) -> None:
    """``--frozen-dtype auto`` decided as effijax train decides it: a LoRA base stored in
    ``precision``'s compute dtype (``plan`` counts bf16, the precision it plans for)."""
    compute = PRESET_COMPUTE.get(PRECISION_ALIASES.get(precision, precision))
    if getattr(args, "frozen_dtype", None) == "auto" and compute is not None:
        args.frozen_dtype = compute  # (an unknown precision is refused under its own name)


def _aliases_text() -> str:
    """'mixed, bfloat16 = bf16; f32, float32, full = fp32; ...' for the --precision help."""
    groups: dict[str, list[str]] = {}
    for alias, name in PRECISION_ALIASES.items():
        groups.setdefault(name, []).append(alias)
    return "; ".join(f"{', '.join(aliases)} = {name}" for name, aliases in groups.items())


_OPTIMIZER_HELP = ("optimizer whose state is counted, as effijax train names them (sgd keeps "
                   "momentum; adafactor's factored moments are counted from the shapes of "
                   "--model or --from)")
# Old spellings a user may still type -> what to write instead (the unknown-flag error says it).
RENAMED = {"--zero": "--strategy (ddp, zero1, zero2, fsdp: ZeRO stages 0 to 3, as effijax "
           "train names them)"}


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it says something: not for a flag without one (None) nor for
    an on/off switch (``--no-lora (default: True)`` reads backwards)."""

    def _get_help_string(self, action):
        if action.required or action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _add_shape_flags(p: argparse.ArgumentParser, batch_flag: str, batch_help: str) -> None:
    g = p.add_argument_group("model shape (for activations; give all or none)")
    g.add_argument("--layers", type=_count, help="transformer blocks L")
    g.add_argument("--hidden", type=_count, help="hidden size h")
    g.add_argument("--heads", type=_count, help="attention heads a")
    g.add_argument("--seq-len", type=_count, help="sequence length s")
    g.add_argument(batch_flag, type=_count, help=batch_help)
    g.add_argument(
        "--no-dropout",
        dest="dropout",
        action="store_false",
        help="no dropout masks in the activations",
    )
    which = g.add_mutually_exclusive_group()
    which.add_argument("--attention", choices=_ATTENTION, default=None,
                       help="the attention the run uses, for its stored s x s scores: naive and "
                       "xla store them, blockwise (flash) keeps only row statistics, auto "
                       "resolves as effijax train does on this machine (blockwise on a CPU, "
                       "cuDNN's fused kernel on a GPU where it applies); default: the model's "
                       "own with --model or --from, else naive")
    which.add_argument("--blockwise-attention", dest="attention", action="store_const",
                       const="blockwise", help="the same as --attention blockwise")


def _add_model_flags(p: argparse.ArgumentParser, params_help: str) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--params", type=_argtype(parse_count, "count"), metavar="COUNT",
                       help=params_help)
    which.add_argument("--model", metavar="PRESET", help="a preset architecture instead of "
                       "--params (llama-2-7b, llama-2-70b, llama-3.1-405b, smollm2-135m, tiny, "
                       "...): its parameter count and shape (grouped-query attention, SwiGLU, "
                       "logits) are used")
    _from.add_flag(which, "a real model instead of --params, its count and shape used as "
                   "--model's", required=False)
    p.add_argument("--lora-rank", type=_count, default=None,
                   help="with --model or --from: LoRA of this rank on the model's default "
                   "targets (all attention and MLP projections); the adapter count is exact")


def _add_objective_flag(p: argparse.ArgumentParser) -> None:
    field = _TRAIN["objective"]
    p.add_argument("--objective", default=field.default, choices=field.metadata["choices"],
                   help="what the run optimises, as effijax train names it: dpo in full "
                   "fine-tuning holds a frozen reference copy of the weights (in "
                   "--frozen-dtype); under LoRA its reference is the base with the adapters "
                   "off, and the others hold none; grpo holds one only with --beta > 0")
    field = _TRAIN["beta"]
    p.add_argument("--beta", type=_beta, default=field.default,
                   help="the objective's beta, as effijax train takes it (default: its TRL "
                   "default); grpo's KL penalty needs a reference only when above 0")
    p.add_argument("--precompute-reference", action="store_true",
                   help="dpo: its reference log-probabilities computed before training, as "
                   "effijax train --precompute-reference does: no reference copy held")


def _reference(args: argparse.Namespace) -> bool:
    """Whether the run holds a reference (:func:`~effijax.recipe.holds_reference`); refuses
    ``--precompute-reference`` away from dpo, as effijax train does."""
    if args.precompute_reference and args.objective != "dpo":
        raise ConfigError("precompute_reference", True, "only applies to --objective dpo "
                          f"(--precompute-reference); {args.objective} precomputes no "
                          "reference")
    return holds_reference(args.objective, args.beta, args.precompute_reference)


def _add_rollout_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("grpo's rollout (with --objective grpo and --model or --from: its "
                             "key/value cache is counted)")
    for name in ("num_generations", "max_completion_length"):
        field = _TRAIN[name]
        g.add_argument("--" + name.replace("_", "-"), type=_count, default=field.default,
                       metavar=field.metadata["metavar"], help=field.metadata["help"])


def _rollout_bytes(args: argparse.Namespace) -> int | None:
    """grpo's rollout between the steps: the key/value cache of ``--batch-size`` completions
    (as train's ``--batch-size`` counts them) whose prompts fill their rows (``seq_len -
    max_completion_length`` tokens), in the compute dtype, as the sampler allocates it
    (:func:`effijax.generate.rollout_cache_bytes`), whole (not divided over the devices).
    None for the other objectives, or without a model's shape (--params)."""
    if args.objective != "grpo" or getattr(args, "architecture", None) is None:
        return None
    if args.batch_size % args.num_generations:
        raise ConfigError("--batch-size", args.batch_size, f"counts completions, "
                          f"--num-generations {args.num_generations} of each prompt: use a "
                          "multiple of it")
    if args.max_completion_length >= args.seq_len:
        raise ConfigError("--max-completion-length", args.max_completion_length, f"leaves no "
                          f"room for a prompt in a row of --seq-len {args.seq_len} tokens: use "
                          "less, or raise --seq-len")
    from effijax.generate import rollout_cache_bytes  # imports JAX, as --model already did

    return rollout_cache_bytes(args.architecture, completions=args.batch_size,
                               prompt_tokens=args.seq_len - args.max_completion_length,
                               max_completion_length=args.max_completion_length,
                               dtype=PRESET_COMPUTE[args.precision])


def _add_optimizer_flag(p: argparse.ArgumentParser) -> None:
    field = _TRAIN["optimizer"]
    p.add_argument("--optimizer", default=field.default, choices=field.metadata["choices"],
                   help=_OPTIMIZER_HELP)


def add_parsers(sub) -> None:
    """Registers ``memory`` and ``plan`` on an ``argparse`` subparsers object.

    Example:
      >>> import argparse
      >>> parser = argparse.ArgumentParser(prog="effijax")
      >>> add_parsers(parser.add_subparsers(dest="command"))
      >>> parser.parse_args(["memory", "--params", "7B"]).params
      7000000000
    """
    m = sub.add_parser(
        "memory",
        help="per-device memory of model states (and activations)",
        description="Per-device bytes of parameters, gradients, optimizer state and "
        "activations, from the analytic formulas. GB = 1e9 bytes.",
        formatter_class=_Help,
    )
    _add_model_flags(m, "parameter count, e.g. 7B, 70e9, 1.5M")
    _add_optimizer_flag(m)
    m.add_argument(
        "--precision",
        default=_TRAIN["precision"].default,
        type=_precision,
        metavar="{" + ",".join(PRECISIONS) + "}",
        help="precision policy (bf16, fp16: 16-bit params and grads, f32 master and moments; "
        "auto: bf16, what effijax train picks on a GPU or TPU); "
        f"also accepted: {_aliases_text()}",
    )
    m.add_argument(
        "--strategy", type=_argtype(_strategy, "strategy"), default=_TRAIN["strategy"].default,
        metavar="{ddp,zero1,zero2,fsdp}",
        help="data-parallel sharding over --devices, as effijax train names it: ddp (nothing "
        "sharded, ZeRO-0), zero1 (optimizer state), zero2 (and gradients), fsdp or zero3 (and "
        "parameters); default: ddp, as train runs without --strategy",
    )
    m.add_argument("--devices", type=_count, default=1, help="data-parallel devices")
    m.add_argument("--tensor", type=_count, default=1,
                   help="tensor-parallel degree t (Megatron's split of each layer over t devices)")
    m.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="with --tensor: split the norm and dropout regions along the sequence "
                   "(default: on with --tensor above 1, as effijax train runs it)")
    m.add_argument("--context", type=_count, default=1,
                   help="context-parallel degree (a --mesh context=N axis: each sequence split "
                   "over N devices, ring attention): the layers' activations split N ways, the "
                   "head and loss whole; needs no dropout")
    m.add_argument(
        "--lora-fraction",
        type=_fraction,
        default=None,
        help="LoRA adapters as a fraction of the parameters, e.g. 0.01",
    )
    m.add_argument(
        "--frozen-dtype",
        default="auto",
        choices=("auto", *FROZEN_DTYPES, "gguf"),
        help="storage of the frozen base under LoRA (auto: the precision's compute dtype, as "
        "effijax train stores it; nf4, int8: with their scales; exact bytes with --model or "
        "--from; gguf: the --from GGUF file's own blocks, exact); in full fine-tuning with "
        "--objective dpo (or grpo with --beta > 0), of the reference copy (a floating dtype)",
    )
    _add_objective_flag(m)
    _add_rollout_flags(m)
    _add_shape_flags(m, "--batch-size", "sequences per device per micro-batch b")
    m.add_argument(
        "--checkpointing", default="none", choices=CHECKPOINTING, help="activation checkpointing"
    )
    m.add_argument("--compile", action="store_true",
                   help="with --model or --from: also compile the step effijax train would run "
                   "(abstract weights, nothing allocated) for --devices x --context x --tensor "
                   "devices of this machine (forced CPU devices where it has no accelerator) "
                   "and print XLA's bytes per device beside the formula's")
    m.add_argument("--json", action="store_true", help="print a JSON object of integer bytes")
    m.set_defaults(func=memory_command)
    m.renamed = RENAMED  # read by the unknown-flag error (effijax.cli._main)

    p = sub.add_parser(
        "plan",
        help="the mesh and the cheapest configuration that fit in device memory",
        description="On every (data, fsdp, tensor) mesh of the devices, tries DDP, ZeRO-1/2/3, "
        "activation checkpointing, smaller micro-batches, then LoRA; prints the meshes "
        f"compared, the one picked ({RULE}) and its arithmetic. "
        "Exit code 0 if one fits, 1 if none does.",
        formatter_class=_Help,
    )
    _add_model_flags(p, "parameter count, e.g. 70B")
    p.add_argument("--devices", type=_count, required=True,
                   help="devices in all, factorised into data x fsdp x tensor")
    p.add_argument("--tensor", type=_count, default=None,
                   help="pin the tensor-parallel degree (must divide --devices); default: "
                   "searched over the divisors the model's heads, MLP width and vocabulary take")
    p.add_argument("--node-size", type=_count, default=None,
                   help="devices per node: the tensor degree stays within one node")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="count tensor-parallel activations with sequence parallelism (default: "
                   "on with a tensor axis, as effijax train runs one)")
    p.add_argument("--context", type=_context_degree, default=1, metavar="{N,search}",
                   help="context-parallel degree (a context=N mesh axis splitting each "
                   "sequence, ring attention; must divide --devices), or search: every degree "
                   "whose 2N chunks split --seq-len, for sequences no other split fits; needs "
                   "no dropout")
    p.add_argument(
        "--device-memory",
        required=True,
        type=_argtype(_size, "size"),
        metavar="SIZE",
        help="memory per device with its unit: 80GB (10**9 bytes), 80GiB (2**30 bytes), "
        "512MiB; a bare number is refused",
    )
    _add_optimizer_flag(p)
    p.add_argument(
        "--headroom", type=_headroom, default=0.1, help="fraction of device memory kept free"
    )
    p.add_argument(
        "--lora-fraction",
        type=_fraction,
        default=0.01,
        help="LoRA adapters as a fraction of the parameters, if LoRA is needed",
    )
    p.add_argument("--no-lora", dest="allow_lora", action="store_false", help="never propose LoRA")
    p.add_argument(
        "--frozen-dtype",
        default="auto",
        choices=("auto", "bf16", *FROZEN_SCALE_BITS),
        help="LoRA's frozen base: auto or bf16 (the compute dtype of the bf16 runs plan counts), "
        "or also try a quantized base (QLoRA) when bf16 does not fit",
    )
    _add_objective_flag(p)
    _add_shape_flags(p, "--global-batch", "global batch in sequences")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=plan_command)


# Library argument names -> the flags that set them, so errors name what the user typed.
_FLAGS = {
    "num_params": "--params",
    "optimizer": "--optimizer",
    "precision": "--precision",
    "strategy": "--strategy",
    "moments": "--optimizer",
    "devices": "--devices",
    "device_memory": "--device-memory",
    "lora_fraction": "--lora-fraction",
    "frozen_dtype": "--frozen-dtype",
    "layers": "--layers",
    "hidden": "--hidden",
    "heads": "--heads",
    "seq_len": "--seq-len",
    "batch_size": "--batch-size",
    "global_batch": "--global-batch",
    "headroom": "--headroom",
    "checkpointing": "--checkpointing",
    "tensor": "--tensor",
    "node_size": "--node-size",
    "context": "--context",
}


def _error(command: str, problem: ConfigError) -> int:
    """Prints the error, naming the flag instead of the library argument; returns exit code 2."""
    named = problem.renamed(_FLAGS.get(problem.field, problem.field))
    print(f"effijax {command}: error: {named}", file=sys.stderr)
    return 2


def _check_shape(args, batch_name: str) -> None:
    """The model-shape flags come all together or not at all."""
    names = (*_SHAPE_FLAGS, batch_name)
    given = [n for n in names if getattr(args, n) is not None]
    if given and len(given) < len(names):
        missing = [n for n in names if n not in given]
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise ConfigError(flags, NO_VALUE, "required with the other model-shape flags (give "
                          "all of them or none)")


def _architecture(args: argparse.Namespace):
    """The model that ``--model`` (a preset) or ``--from`` (a source) names.

    Raises:
      ConfigError: naming the flag: not a preset, a preset given as a source, or a source
        that cannot be read.
    """
    source = args.model_from
    if source is not None and _from.names_a_source(source):
        _from.check_exists(source)  # a path that names nothing is said before JAX is imported
    if args.model is not None and _from.names_a_source(args.model):  # the same, before JAX
        raise ConfigError("--model", args.model, f"is not a preset but a model to read: give "
                          f"{_from.FLAG} {args.model}")
    # Imported here: the presets are the models' (JAX), which --params never needs.
    from effijax.models import preset_names
    from effijax.sources import architecture

    if args.model is not None:
        if args.model not in preset_names():
            raise ConfigError("--model", args.model, f"not a preset ({', '.join(preset_names())})"
                              f"; a run directory, a .gguf file, a Hugging Face directory or "
                              f"smollm2 goes in {_from.FLAG}")
        return architecture(args.model, seq_len=args.seq_len, field="--model")
    if source in preset_names():  # architecture() would take it: say where it goes
        raise ConfigError(_from.FLAG, source, f"is a preset; give --model {source}")
    _from.check_exists(source)
    return architecture(source, seq_len=args.seq_len, field=_from.FLAG)


def _model_shape(args: argparse.Namespace, batch_name: str) -> dict:
    """With ``--model`` or ``--from``: fills ``args.params`` and the shape flags from the model
    (a given ``--seq-len`` wins; the batch defaults to 1) and returns the extra shape arguments
    of :func:`effijax.memory.activation_bytes`; without them, ``{}``.

    Raises:
      ConfigError: the model cannot be read, or a shape flag contradicts it.
    """
    which = "--model" if args.model is not None else _from.FLAG
    if args.lora_rank is not None and args.params is not None:
        raise ConfigError("--lora-rank", args.lora_rank, f"needs --model or {_from.FLAG} (with "
                          "--params, give --lora-fraction)")
    if args.params is not None:
        if getattr(args, "frozen_dtype", None) == "gguf":
            raise ConfigError("--frozen-dtype", "gguf", f"counts a GGUF file's own blocks: give "
                              f"the file with {_from.FLAG} FILE.gguf instead of --params")
        return {}
    given = [n for n in ("layers", "hidden", "heads") if getattr(args, n) is not None]
    if given:
        raise ConfigError("--" + given[0], getattr(args, given[0]), f"the {which} gives the "
                          "shape; drop it (only --seq-len and the batch may be set)")
    model = _architecture(args)
    args.architecture = model  # for adafactor's state, counted from its shapes
    shape = model.shape()
    args.params = shape.num_params
    args.layers, args.hidden, args.heads = shape.layers, shape.hidden, shape.heads
    args.seq_len = shape.seq_len
    if getattr(args, batch_name) is None:
        setattr(args, batch_name, getattr(args, "devices", 1) if batch_name == "global_batch"
                else 1)
    args.dropout = args.dropout and getattr(model, "dropout", 0) > 0
    if args.lora_rank is not None:
        args.lora_fraction = _adapter_count(model, args.lora_rank) / shape.num_params
    args.model_name = getattr(model, "name", args.model or args.model_from)
    if args.attention is None:
        args.attention = getattr(model, "attention", "naive")
    args.frozen_bytes = _quantized_base_bytes(model, getattr(args, "frozen_dtype", "bf16"),
                                              args.model_from, getattr(args, "precision", None))
    # layers, hidden and heads travel in args with the shape flags they stand for.
    return {k: v for k, v in shape.activation_args().items()
            if k not in ("layers", "hidden", "heads")}


def _quantized_base_bytes(model, frozen_dtype: str, source: str | None,
                          precision: str | None) -> int | None:
    """Exact bytes of the model's base stored as a quantized ``frozen_dtype`` (codes, scales
    and the unquantized leaves in bf16), from its shapes, or for ``gguf`` from ``source``'s
    header (the unquantized leaves in the compute dtype, as training holds them); None for a
    floating dtype."""
    from effijax.memory import frozen_base_bytes  # imports JAX, which --params never needs

    if frozen_dtype == "gguf":
        from effijax.interop import gguf_kept_bytes, is_gguf
        from effijax.sources import BUNDLED, bundled_path

        path = bundled_path(source) if source in BUNDLED else source
        if path is None or not is_gguf(path):
            raise ConfigError("--frozen-dtype", "gguf", f"counts a GGUF file's own blocks: "
                              f"give the file with {_from.FLAG} FILE.gguf (or a bundled GGUF "
                              "model, e.g. smollm2)")
        return gguf_kept_bytes(path, dtype="fp32" if precision == "fp32" else "bf16")
    if frozen_dtype not in FROZEN_SCALE_BITS:
        return None
    return frozen_base_bytes(model.abstract_params(), frozen_dtype)


def _adapter_count(model, rank: int) -> int:
    """Adapter parameters of a rank-``rank`` LoRA on the model's default targets (shapes only;
    nothing is allocated)."""
    import jax

    from effijax import lora

    spec = lora.LoraSpec(rank=rank, targets=model.lora_targets)
    abstract = model.abstract_params()
    return lora.count_params(jax.eval_shape(lambda k: lora.init(k, abstract, spec),
                                            jax.random.key(0)))


def _shape(args: argparse.Namespace, batch_name: str) -> dict:
    """The model shape's arguments, as :func:`~effijax.memory.activation_bytes` and
    :func:`~effijax.memory.plan` both take them (after :func:`_model_shape`)."""
    extra = _model_shape(args, batch_name)
    _check_shape(args, batch_name)
    names = (*_SHAPE_FLAGS, batch_name, "dropout")
    shape = {**{name: getattr(args, name) for name in names}, **extra}
    if args.attention is None:
        args.attention = "naive"  # no model: the formula of Korthikanti et al. (2022)
    shape["blockwise_attention"] = args.layers is not None and not _keeps_scores(args, shape)
    return shape


def _keeps_scores(args: argparse.Namespace, shape: dict) -> bool:
    """Whether ``args.attention`` stores the s x s scores; ``"auto"`` resolved as on this
    machine for the precision's compute dtype (bf16 for ``plan``, which runs mixed)."""
    if args.attention != "auto":
        return args.attention != "blockwise"
    import jax
    import jax.numpy as jnp

    from effijax.models import choose_attention, keeps_scores, target_backend

    dtype = {"fp32": jnp.float32, "fp16": jnp.float16}.get(getattr(args, "precision", None),
                                                           jnp.bfloat16)
    head_dim = shape.get("head_dim") or args.hidden // args.heads
    q = jax.ShapeDtypeStruct((1, args.seq_len, args.heads, head_dim), dtype)
    choice = choose_attention(q, dropout=args.dropout)
    name = "cuDNN's fused kernel" if choice.fused else choice.name
    args.attention_used = f"{name} on {target_backend()}"  # for the table's model line
    return keeps_scores("auto", q, dropout=args.dropout)


def _adafactor_values(args: argparse.Namespace) -> int | None:
    """With ``--optimizer adafactor``: its state values (factored second moments), counted
    from the model's shapes by effijax train's own optimizer; None for another optimizer.

    Raises:
      ConfigError: adafactor with a bare --params, or with LoRA given as --lora-fraction (no
        shapes to count).
    """
    if OPTIMIZERS[args.optimizer] is not None:
        return None
    model = getattr(args, "architecture", None)
    if model is None:
        raise ConfigError("--optimizer", "adafactor", f"keeps factored second moments (r + c "
                          f"values per r x c matrix, not r x c), which --params alone cannot "
                          f"count: give the model with --model or {_from.FLAG} instead of "
                          "--params")
    if args.lora_fraction is not None and args.lora_rank is None:
        raise ConfigError("--optimizer", "adafactor", "counts its state from the adapters' "
                          "shapes: give LoRA as --lora-rank R instead of --lora-fraction")
    import jax
    import jax.numpy as jnp

    from effijax import lora
    from effijax.optimizers import make_optimizer

    trained = model.abstract_params()
    if args.lora_rank is not None:
        spec = lora.LoraSpec(rank=args.lora_rank, targets=model.lora_targets)
        base = trained
        trained = jax.eval_shape(lambda k: lora.init(k, base, spec), jax.random.key(0))
    tx = make_optimizer(1e-3, 1, optimizer="adafactor", clip_norm=None)
    state = jax.eval_shape(tx.init, trained)
    # Every floating array of the state: the factored rows and columns, the whole v of the
    # leaves too small to factor (and the one-element placeholders optax keeps beside them);
    # scalars (the step count, the injected hyperparameters) are not moments.
    return sum(leaf.size for leaf in jax.tree.leaves(state)
               if leaf.ndim and jnp.issubdtype(leaf.dtype, jnp.floating))


def memory_command(args: argparse.Namespace) -> int:
    """Handler of ``effijax memory``; returns the exit code."""
    if args.compile and args.params is None:  # before the model's shapes start JAX's backends
        _compiled.claim_devices(args)  # (--params imports no JAX: check() refuses it below)
    try:
        _resolve_precision(args)
        if args.objective == "grpo" and args.params is None and args.batch_size is None:
            args.batch_size = args.num_generations  # one prompt's group, the least train takes
        shape = _shape(args, "batch_size")  # with --model or --from, it sets args.params
        if args.sequence_parallel is None:  # as effijax train: on with a tensor axis
            args.sequence_parallel = args.tensor > 1
        args.strategy = args.strategy or "ddp"
        args.state_values = _adafactor_values(args)
        reference = _reference(args)
        states = model_states(args.params, optimizer=args.optimizer, precision=args.precision,
                              zero_stage=_zero_stage(args.strategy), devices=args.devices,
                              lora_fraction=args.lora_fraction, frozen_dtype=args.frozen_dtype,
                              tensor=args.tensor,
                              frozen_bytes=getattr(args, "frozen_bytes", None),
                              moments=_moments(args, states_of=args.state_values),
                              reference=reference)
        acts = None if args.layers is None else activation_bytes(
            **shape, bytes_per_value=4 if args.precision == "fp32" else 2,
            checkpointing=args.checkpointing, tensor=args.tensor,
            sequence_parallel=args.sequence_parallel, context=args.context)
        args.rollout_bytes = _rollout_bytes(args)
        # What --compile cannot compile is refused before anything is printed or compiled.
        target = _compiled.check(args, reference=reference) if args.compile else None
    except ConfigError as e:
        return _error("memory", e)
    # A rollout runs between the steps: its cache and the step's activations are never held
    # together.
    total = states.model_state_bytes + max(acts or 0, args.rollout_bytes or 0)
    if not args.json:  # the formula's answer at once; the compiler's follows
        print(_memory_text(args, shape, states, acts, total), flush=True)
    compiled = None
    if target is not None:
        try:
            compiled = _compiled.compiled_bytes(args, target)
        except ConfigError as e:
            return _error("memory", e)
    if args.json:
        out = {"strategy": args.strategy, **dataclasses.asdict(states)}
        if args.state_values is not None:
            out["optimizer_state_values"] = args.state_values
        if acts is not None:
            out["activation_bytes"] = acts
        if args.rollout_bytes is not None:
            out["rollout_cache_bytes"] = args.rollout_bytes
        out["total_bytes"] = total
        if compiled is not None:
            out["compiled"] = {**compiled._asdict(), "activation_bytes": compiled.activations}
        print(json.dumps(out, indent=2))
    elif compiled is not None:
        print(_compiled.compiled_text(compiled, acts, frozen=(
            "frozen base" if args.lora_rank is not None else "reference" if reference else "")))
    return 0


def _memory_text(args: argparse.Namespace, shape: dict, states, acts: int | None,
                 total: int) -> str:
    """``effijax memory``'s table: the model and setting, then bytes per device."""
    if args.lora_fraction is None:
        lora = (f", {args.objective}: a {args.frozen_dtype} reference copy"
                if _reference(args) else "")
    elif args.lora_rank is not None:
        lora = (f", LoRA rank {args.lora_rank} ({states.trainable_params:,} adapter params, "
                f"{args.frozen_dtype} frozen base)")
    else:
        lora = f", LoRA {args.lora_fraction:g} ({args.frozen_dtype} frozen base)"
    if args.lora_fraction is not None and _reference(args):
        lora += f", {args.objective} against the base with the adapters off (no copy)"
    if args.precompute_reference:
        lora += f", {args.objective}: the reference's log-probabilities precomputed (no copy)"
    model = "" if "vocab" not in shape else (
        f"{args.model_name}: {args.layers} layers, width {args.hidden}, {args.heads} heads "
        f"({shape['kv_heads']} key/value), {'SwiGLU ' if shape['gated_mlp'] else 'MLP '}"
        f"{shape['ffn']}, vocabulary {shape['vocab']:,}; seq_len {args.seq_len}, batch "
        f"{args.batch_size}; attention {_attention_text(args, shape)}\n")
    optimizer = args.optimizer if args.state_values is None else (
        f"{args.optimizer} ({args.state_values:,} factored state values)")
    precision = args.precision if args.precision_why is None else (
        f"{args.precision} ({args.precision_why})")
    lines = [f"{model}{args.params:,} params, {optimizer}, {precision}{lora}, "
             f"{args.strategy} (ZeRO-{states.zero_stage}) on {args.devices} device(s)"
             + (f" x tensor {args.tensor}{' (sequence-parallel)' if args.sequence_parallel else ''}"
                if args.tensor > 1 else "")
             + (f" x context {args.context} (ring attention)" if args.context > 1 else "")
             + "; bytes per device (GB = 1e9 bytes)"]
    rows = [
        ("params", states.params_bytes),
        ("grads", states.grads_bytes),
        ("optimizer", states.optimizer_bytes),
        ("  of which f32 master", states.master_bytes),
        ("model states", states.model_state_bytes),
    ]
    if args.lora_fraction is None and states.frozen_bytes:  # under params, as train holds it
        rows.insert(1, ("  of which reference", states.frozen_bytes))
    if acts is not None:
        rows += [("activations", acts)]
        if args.rollout_bytes is not None:  # between the steps, instead of the activations
            rows += [("rollout KV cache", args.rollout_bytes)]
        rows += [("total", total)]
    lines += [f"  {name:<22}{format_bytes(value):>12}  {value:>18,}" for name, value in rows]
    return "\n".join(lines)


def _moments(args: argparse.Namespace, states_of: int | None):
    """Optimizer-state values per trained parameter when counted from the shapes (adafactor);
    None takes the optimizer's own count."""
    if states_of is None:
        return None
    from fractions import Fraction

    trained = (args.params if args.lora_fraction is None
               else max(1, round(args.lora_fraction * args.params)))
    return Fraction(states_of, trained)


def _attention_text(args: argparse.Namespace, shape: dict) -> str:
    """'naive (s x s scores stored)', 'auto = blockwise on cpu (no s x s scores)', ..."""
    if shape["blockwise_attention"]:
        kept = "no s x s scores"
    else:
        kept = "s x s scores stored"
    if args.attention != "auto":
        return f"{args.attention} ({kept})"
    return f"auto = {args.attention_used} ({kept})"


def plan_command(args: argparse.Namespace) -> int:
    """Handler of ``effijax plan``; returns 0 if a configuration fits, 1 if none does."""
    try:
        _resolve_frozen(args, "bf16")  # plan counts mixed-precision (bf16) runs
        shape = _shape(args, "global_batch")  # with --model or --from, it sets args.params
        if args.sequence_parallel is None:  # as effijax train: on with a tensor axis
            args.sequence_parallel = True  # (the mesh search applies it where tensor > 1)
        quantized = None if args.frozen_dtype == "bf16" else args.frozen_dtype
        result = plan_mesh(args.params, devices=args.devices, device_memory=args.device_memory,
                           optimizer=args.optimizer, allow_lora=args.allow_lora,
                           headroom=args.headroom, lora_fraction=args.lora_fraction,
                           tensor=args.tensor, node_size=args.node_size,
                           sequence_parallel=args.sequence_parallel, quantized_base=quantized,
                           quantized_bytes=getattr(args, "frozen_bytes", None),
                           reference=_reference(args),
                           context=args.context, **shape)
    except ConfigError as e:
        return _error("plan", e)
    if args.json:
        print(json.dumps(_plan_json(result), indent=2))
    else:
        print(result.explain())
    return 0 if result.fits else 1


def _candidate_json(c) -> dict:
    return {"mesh": c.mesh, "strategy": c.strategy, "fits": c.plan.fits, "lora": c.plan.lora,
            "checkpointing": c.plan.checkpointing, "micro_batch": c.plan.micro_batch,
            "grad_accum_steps": c.plan.grad_accum_steps, "total_bytes": c.plan.total_bytes,
            "communication_bytes": c.communication, "tensor_wire_bytes": c.tensor_wire_bytes}


def _plan_json(result) -> dict:
    """The picked plan's fields (those of the pure-fsdp mesh when nothing fits), its mesh, and
    every candidate."""
    chosen = result.candidates[0].plan  # the pick, or the explained candidate when none fits
    out = {field.name: getattr(chosen, field.name) for field in dataclasses.fields(chosen)
           if field.name not in ("states", "steps")}
    out["lora"] = chosen.lora
    out["states"] = None if chosen.states is None else dataclasses.asdict(chosen.states)
    out["explain"] = list(chosen.steps)
    out["mesh"] = None if result.pick is None else result.pick.mesh
    out["strategy"] = None if result.pick is None else result.pick.strategy
    out["communication_bytes"] = None if result.pick is None else result.pick.communication
    out["rule"] = RULE
    out["notes"] = list(result.notes)
    out["candidates"] = [_candidate_json(c) for c in result.candidates]
    return out
