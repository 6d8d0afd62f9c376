"""Adapter files: effijax's own safetensors format, and export to Hugging Face PEFT's layout.

:func:`save_adapters` writes only the adapters (a few MB for a multi-GB base) to one
``.safetensors`` file: tensor names are the '/'-joined adapter paths plus ``/a`` or ``/b``
(``blocks/attn/q/kernel/a``), arrays keep their Flax layout and dtype, and the :class:`LoraSpec`
is stored as JSON in the file's metadata (no pickle). :func:`load_adapters` reads it back bitwise.

:func:`export_peft` writes what ``peft.PeftModel.from_pretrained`` reads: ``adapter_config.json``
and ``adapter_model.safetensors`` in torch's ``(out, in)`` layout, one matrix per layer.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.flax

from effijax import atomic
from effijax.errors import ConfigError
from effijax.lora._adapters import _nest, pairs, validate
from effijax.lora._spec import LoraSpec

__all__ = ["save_adapters", "load_adapters", "export_peft", "peft_module_name"]

_FORMAT = "effijax-lora"
_FORMAT_VERSION = "1"


def _spec_to_json(spec: LoraSpec, paths: list[str]) -> str:
    targets = spec.targets
    if not isinstance(targets, str):
        # A predicate cannot be stored; the paths it selected can, as an anchored regex.
        targets = "^(" + "|".join(re.escape(p) for p in sorted(paths)) + ")$"
    return json.dumps({
        "rank": spec.rank,
        "alpha": spec.alpha,
        "targets": targets,
        "overrides": [list(rule) for rule in spec.overrides],
        "rslora": spec.rslora,
        "dropout": spec.dropout,
        "init": spec.init,
        "dtype": spec.dtype.name,
    }, sort_keys=True)


def _spec_from_json(text: str, path) -> LoraSpec:
    try:
        fields = json.loads(text)
        fields["overrides"] = tuple(tuple(rule) for rule in fields.get("overrides", ()))
        return LoraSpec(**fields)
    except (ValueError, TypeError) as e:
        raise ConfigError("path", str(path), f"the stored LoRA spec is invalid: {e}") from e


def _sorted_metadata(data: bytes) -> bytes:
    """``data`` (a safetensors file) with its metadata's keys in sorted order: safetensors keeps
    them in a hash map whose order changes from call to call, and the same adapters must give
    the same bytes (a completed run's end equals an uninterrupted one's). The header keeps its
    length (padded with spaces, which the format allows), so the offsets stay valid."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > length:  # another escaping than safetensors': keep its bytes
        return data
    return data[:8] + text.ljust(length) + data[8 + length:]


def save_adapters(path: str | os.PathLike, adapters, spec: LoraSpec) -> None:
    """Writes the adapters alone (and the spec) to one safetensors file.

    Args:
      path: the file to write (conventionally ``*.safetensors``); its folder must exist.
      adapters: the adapter tree (see :func:`effijax.lora.init`).
      spec: the :class:`LoraSpec` they were made with; a predicate ``targets`` is stored as
        a regex matching exactly the adapted paths.

    Example:
      >>> import os, tempfile, jax, jax.numpy as jnp
      >>> from effijax.lora import init
      >>> spec = LoraSpec(rank=2, targets="w")
      >>> adapters = init(jax.random.key(0), {"w": jnp.zeros((4, 4))}, spec)
      >>> file = os.path.join(tempfile.mkdtemp(), "adapters.safetensors")
      >>> save_adapters(file, adapters, spec)
      >>> loaded, loaded_spec = load_adapters(file)
      >>> loaded_spec == spec, bool(jnp.all(loaded["w"]["a"] == adapters["w"]["a"]))
      (True, True)
    """
    flat = pairs(adapters)
    folder = os.path.dirname(os.fspath(path)) or "."
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"save_adapters: folder {folder!r} does not exist")
    tensors = {}
    for name, (a, b) in flat.items():
        tensors[f"{name}/a"] = jnp.asarray(a)
        tensors[f"{name}/b"] = jnp.asarray(b)
    metadata = {"format": _FORMAT, "version": _FORMAT_VERSION,
                "spec": _spec_to_json(spec, list(flat))}
    # Whole or not at all (a killed export leaves no truncated file that looks complete), and
    # 0644 like any output file: safetensors' save_file creates its files 0600.
    atomic.write_bytes(path, _sorted_metadata(safetensors.flax.save(tensors, metadata=metadata)))


def load_adapters(path: str | os.PathLike, params=None) -> tuple[dict, LoraSpec]:
    """Reads adapters written by :func:`save_adapters`, bitwise, with their spec.

    Args:
      path: the ``.safetensors`` file.
      params: optionally, the base parameters (or their ``jax.eval_shape``) to check the
        adapters against: every adapted path must exist and the shapes must fit.

    Returns:
      ``(adapters, spec)``.

    Raises:
      FileNotFoundError: no such file.
      ConfigError: the file is not an effijax adapter file, or the adapters do not fit ``params``
        (the message names the path and both shapes).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"load_adapters: no adapter file at {os.fspath(path)!r} (write one with "
            "effijax.lora.save_adapters)"
        )
    try:
        metadata, flat = _read(path)
    except safetensors.SafetensorError as e:
        # A file cut short (a run killed while an older effijax exported it) or damaged.
        raise ConfigError("path", os.fspath(path), f"is not a whole safetensors file ({e}); "
                          "write it again (the train command that made it completes its run's "
                          "end)") from None
    spec = _spec_from_json(metadata["spec"], path)
    for kernel_path, pair in flat.items():
        if set(pair) != {"a", "b"}:
            raise ConfigError("path", os.fspath(path), f"{kernel_path!r} lacks its a or b tensor")
    adapters = _nest(flat)
    if params is not None:
        validate(params, adapters, spec)
    return adapters, spec


def _read(path) -> tuple[dict, dict]:
    """An adapter file's metadata and its ``{kernel path: {"a"|"b": array}}``."""
    with safetensors.safe_open(path, framework="flax") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != _FORMAT or "spec" not in metadata:
            raise ConfigError(
                "path", os.fspath(path),
                "is not an effijax adapter file (no 'format': 'effijax-lora' metadata); PEFT "
                "exports and full checkpoints cannot be loaded here",
            )
        flat = {}
        for name in f.keys():
            kernel_path, _, which = name.rpartition("/")
            if which not in ("a", "b") or not kernel_path:
                raise ConfigError("path", os.fspath(path), f"unexpected tensor {name!r}")
            flat.setdefault(kernel_path, {})[which] = f.get_tensor(name)
    return metadata, flat


def peft_module_name(path: str, layer: int | None = None) -> str:
    """The torch module name PEFT sees for the kernel at ``path`` (and layer, if stacked).

    The kernel's own name is dropped, '/' becomes '.', and a stacked kernel's layer index goes
    right after the first path part (the scanned module): ``blocks/attn/q/kernel``, layer 3, is
    ``blocks.3.attn.q``.

    Example:
      >>> peft_module_name("blocks/attn/q/kernel", 3), peft_module_name("head/kernel")
      ('blocks.3.attn.q', 'head')
    """
    parts = path.split("/")[:-1]
    if not parts:
        raise ConfigError("path", path, "a PEFT module name needs a module above the kernel")
    if layer is not None:
        parts = [parts[0], str(layer), *parts[1:]]
    return ".".join(parts)


def _alpha_json(alpha: float):
    return int(alpha) if float(alpha).is_integer() else alpha


def export_peft(directory: str | os.PathLike, adapters, spec: LoraSpec, *,
                base_model_name: str = "effijax-gpt",
                module_name: Callable[[str, int | None], str] | None = None,
                target_modules: Sequence[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` in PEFT's format.

    Module names follow ``module_name`` (default :func:`peft_module_name`); a kernel stacked
    over layers ``(L, d_in, d_out)`` is unstacked into ``L`` modules. Tensors use torch's
    ``(out, in)`` layout: ``base_model.model.<module>.lora_A.weight = a[i].T`` with shape
    ``(r, d_in)`` and ``...lora_B.weight = b[i].T`` with shape ``(d_out, r)``, in the adapters'
    dtype. ``target_modules`` lists the exact module names unless given; per-module ranks and
    alphas that differ from the spec's (its ``overrides``) go to ``rank_pattern`` /
    ``alpha_pattern``.

    Args:
      directory: created if missing.
      adapters: the adapter tree.
      spec: the :class:`LoraSpec` they were made with.
      base_model_name: ``base_model_name_or_path`` in the config.
      module_name: ``module_name(path, layer) -> str``, the torch module of an adapted kernel
        (one layer of a stacked one); how a model's parameter paths map to its torch twin's.
      target_modules: written as ``target_modules`` instead of the exact names (e.g. PEFT's
        usual suffixes ``["q_proj", "v_proj"]`` when every layer is adapted).

    Returns:
      ``{tensor name: shape}`` of what was written.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp
      >>> from effijax.lora import init
      >>> params = {"blocks": {"attn": {"q": {"kernel": jnp.zeros((2, 16, 32))}}}}
      >>> spec = LoraSpec(rank=4, targets="q/kernel")
      >>> adapters = init(jax.random.key(0), params, spec)
      >>> written = export_peft(tempfile.mkdtemp(), adapters, spec)
      >>> for name, shape in written.items(): print(name, shape)
      base_model.model.blocks.0.attn.q.lora_A.weight (4, 16)
      base_model.model.blocks.0.attn.q.lora_B.weight (32, 4)
      base_model.model.blocks.1.attn.q.lora_A.weight (4, 16)
      base_model.model.blocks.1.attn.q.lora_B.weight (32, 4)
    """
    module_name = module_name or peft_module_name
    tensors, modules, rank_pattern, alpha_pattern = {}, [], {}, {}
    for path, (a, b) in sorted(pairs(adapters).items()):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim == 2:
            layers = [(None, a, b)]
        elif a.ndim == 3:
            layers = [(i, a[i], b[i]) for i in range(a.shape[0])]
        else:
            raise ConfigError(
                "adapters", path,
                f"shape {a.shape}: PEFT export handles (d_in, r) and one stacked layer axis "
                "(L, d_in, r) only",
            )
        for layer, a_DR, b_RF in layers:
            module = module_name(path, layer)
            modules.append(module)
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = jnp.asarray(np.ascontiguousarray(a_DR.T))
            tensors[f"{prefix}.lora_B.weight"] = jnp.asarray(np.ascontiguousarray(b_RF.T))
            if spec.rank_for(path) != spec.rank:
                rank_pattern[module] = spec.rank_for(path)
            if spec.alpha_for(path) != spec.alpha:
                alpha_pattern[module] = _alpha_json(spec.alpha_for(path))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": spec.rank,
        "lora_alpha": _alpha_json(spec.alpha),
        "target_modules": modules if target_modules is None else list(target_modules),
        "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True if spec.init == "kaiming" else "gaussian",
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "modules_to_save": None,
    }
    os.makedirs(directory, exist_ok=True)
    atomic.write_text(os.path.join(directory, "adapter_config.json"),
                      json.dumps(config, indent=2, sort_keys=True))
    atomic.write_bytes(os.path.join(directory, "adapter_model.safetensors"),
                       safetensors.flax.save(tensors, metadata={"format": "pt"}))
    return {name: tuple(t.shape) for name, t in tensors.items()}
