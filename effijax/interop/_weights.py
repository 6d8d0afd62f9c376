"""Tensor names in other formats, name checks, and placement leaf by leaf.

Each family's table (its :class:`~effijax.models.PretrainedFormat`'s ``tensors``) maps each
effijax parameter path to its Hugging Face and GGUF tensor names (per layer for the stacked
ones); :data:`TENSORS` is their union. Loading goes through :func:`assemble_params`: for one
parameter at a time it reads that parameter's tensors (every layer of a stacked one) into one
host buffer in the parameter's dtype and layout, places it on its target sharding, and drops
the buffer, so the host holds at most one parameter beyond what is already placed. Before
anything is read, :func:`check_tensors` compares the names and shapes a file offers with what
the config needs and names every missing, unexpected and misshaped tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from effijax.errors import ConfigError, FileError
from effijax.models import PRETRAINED, LlamaConfig
from effijax.paths import named_leaves

__all__ = ["TENSORS", "hf_name", "gguf_name", "expected_hf_shapes", "check_tensors",
           "assemble_params", "to_flax", "to_hf", "host_array"]

#: effijax path -> (Hugging Face name, GGUF name), every registered family's table in one (a path
#: has the same names in every family that has it); ``{i}`` is the layer of a stacked parameter.
TENSORS: dict[str, tuple[str, str]] = {
    path: names for fmt in PRETRAINED.values() for path, names in fmt.tensors.items()}

_SHOWN = 12


def _layers(path: str, config: LlamaConfig) -> list[int | None]:
    return list(range(config.n_layers)) if path.startswith("layers/") else [None]


def hf_name(path: str, layer: int | None = None) -> str:
    """The Hugging Face tensor name of a parameter (one layer of a stacked one).

    Example:
      >>> hf_name("layers/attn/q_proj/kernel", 3)
      'model.layers.3.self_attn.q_proj.weight'
    """
    return TENSORS[path][0].format(i=layer)


def gguf_name(path: str, layer: int | None = None) -> str:
    """The GGUF (llama.cpp) tensor name of a parameter.

    Example:
      >>> gguf_name("layers/mlp/down_proj/kernel", 0), gguf_name("embed/embedding")
      ('blk.0.ffn_down.weight', 'token_embd.weight')
    """
    return TENSORS[path][1].format(i=layer)


def to_flax(path: str, w: np.ndarray) -> np.ndarray:
    """A tensor in torch's layout as the effijax parameter (kernels transposed to (in, out))."""
    return w.T if path.endswith("/kernel") else w


def to_hf(path: str, w: np.ndarray) -> np.ndarray:
    """One layer of an effijax parameter in torch's (out, in) layout, contiguous."""
    return np.ascontiguousarray(w.T if path.endswith("/kernel") else w)


def expected_hf_shapes(config: LlamaConfig) -> dict[str, tuple[str, int | None, tuple]]:
    """``{Hugging Face name: (effijax path, layer, torch shape)}`` of every tensor the model has.

    Example:
      >>> from effijax.models import llama_config
      >>> shapes = expected_hf_shapes(llama_config("llama-tiny"))
      >>> len(shapes), shapes["model.layers.1.self_attn.k_proj.weight"]
      (21, ('layers/attn/k_proj/kernel', 1, (32, 64)))
    """
    out = {}
    for path, leaf in named_leaves(config.abstract_params()):
        shape = leaf.shape[1:] if path.startswith("layers/") else leaf.shape
        torch_shape = tuple(reversed(shape)) if path.endswith("/kernel") else tuple(shape)
        for layer in _layers(path, config):
            out[hf_name(path, layer)] = (path, layer, torch_shape)
    return out


def _listing(names) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def check_tensors(expected: Mapping[str, tuple], found: Mapping[str, tuple], *, source: str,
                  ignored: Callable[[str], bool] = lambda name: False) -> None:
    """Raises one :class:`~effijax.errors.FileError` naming every missing, unexpected and
    misshaped tensor.

    Args:
      expected: ``{name: shape}`` the model needs.
      found: ``{name: shape}`` the file has.
      source: the file, for the message.
      ignored: names to skip that the format may carry without the model needing them.

    Example:
      >>> check_tensors({"a": (2,), "b": (3,)}, {"a": (2,), "c": (1,)}, source="x")
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: x: tensors: 1 tensor(s) missing: b; 1 unexpected: c
    """
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected and not ignored(n)]
    misshaped = [f"{n} is {tuple(found[n])}, expected {tuple(expected[n])}"
                 for n in expected if n in found and tuple(found[n]) != tuple(expected[n])]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_listing(unexpected)}")
    if misshaped:
        problems.append(f"{len(misshaped)} misshaped: {_listing(misshaped)}")
    if problems:
        raise FileError(source, "tensors", "; ".join(problems))


def _leaf_shardings(shardings, abstract) -> dict[str, Any]:
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        return {path: shardings for path, _ in named_leaves(abstract)}
    flat = dict(named_leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
    paths = {path for path, _ in named_leaves(abstract)}
    if set(flat) != paths:
        raise ConfigError("shardings", "tree", f"does not match the parameters: missing "
                          f"{_listing(paths - set(flat))}, unexpected "
                          f"{_listing(set(flat) - paths)}")
    return flat


def place(buffer: np.ndarray, sharding) -> jax.Array:
    """A host buffer on its sharding (each device receives its slice), or the default device."""
    if sharding is None:
        return jax.device_put(buffer)
    return jax.make_array_from_callback(buffer.shape, sharding, lambda index: buffer[index])


def _place_kept(blocks, sharding):
    """A kernel kept as a GGUF file's blocks, its leaves placed like the kernel's sharding."""
    from effijax.precision import ggml_sharding

    if sharding is None:
        return jax.tree.map(jax.device_put, blocks)
    return jax.tree.map(place, blocks, ggml_sharding(sharding, blocks))


def assemble_params(config: LlamaConfig, read: Callable[[str], np.ndarray], *, policy=None,
             shardings=None, kept: dict | None = None) -> dict:
    """Builds the parameter tree one parameter at a time from tensors in torch's layout.

    Args:
      config: the architecture.
      read: ``read(hf_name) -> array`` in torch's (out, in) layout (any float dtype).
      policy: gives each parameter's dtype (``config.abstract_params(policy)``).
      shardings: a tree of shardings like the parameters, one sharding for all, or None (the
        default device).
      kept: ``{path: GGMLBlocks}``: kernels kept as a GGUF file's blocks (host arrays), used
        as they are instead of read.

    Returns:
      The parameters, matching ``config.abstract_params(policy)`` in structure, shape, dtype.
    """
    abstract = config.abstract_params(policy)
    targets = _leaf_shardings(shardings, abstract)
    leaves = []
    for path, leaf in named_leaves(abstract):
        if kept and path in kept:
            leaves.append(_place_kept(kept[path], targets.get(path)))
            continue
        buffer = np.empty(leaf.shape, leaf.dtype)
        for layer in _layers(path, config):
            w = to_flax(path, read(hf_name(path, layer)))
            if layer is None:
                buffer[...] = w
            else:
                buffer[layer] = w
            del w
        leaves.append(place(buffer, targets.get(path)))
        del buffer
    return jax.tree.unflatten(jax.tree.structure(abstract), leaves)


def host_array(x) -> np.ndarray:
    """A (possibly sharded) array as one host numpy array."""
    return np.asarray(jax.device_get(x))
