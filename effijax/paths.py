"""Parameter paths: the '/'-joined names that every regex rule in effijax matches.

A leaf of a parameter pytree is named by its key path joined with ``/``:
``{"blocks": {"attn": {"q": {"kernel": w}}}}`` names ``w`` as ``"blocks/attn/q/kernel"``.
Dict keys, attribute names, sequence indices and NamedTuple fields all become path parts, so the
same rule works on dicts, ``nnx.State`` pure dicts and optimizer states. Precision overrides,
sharding rules and LoRA targets all go through :func:`path_of` and :func:`compile_pattern`, so
a pattern that works in one place works in the others.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["path_of", "named_leaves", "compile_pattern", "map_with_path"]


def _part(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_of(keypath: tuple) -> str:
    """Joins a jax key path into a '/'-separated string.

    Example:
      >>> import jax
      >>> flat, _ = jax.tree_util.tree_flatten_with_path({"a": {"b": 1}, "c": [2]})
      >>> [path_of(p) for p, _ in flat]
      ['a/b', 'c/0']
    """
    return "/".join(_part(k) for k in keypath)


def named_leaves(tree, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """Returns ``[(path, leaf), ...]`` in the tree's flatten order.

    Example:
      >>> named_leaves({"w": 1, "b": 2})
      [('b', 2), ('w', 1)]
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_of(p), leaf) for p, leaf in flat]


def map_with_path(fn: Callable[[str, Any], Any], tree, *rest, is_leaf=None):
    """``jax.tree.map`` whose function also receives the leaf's '/'-joined path first.

    Example:
      >>> map_with_path(lambda path, x: f"{path}={x}", {"a": {"b": 1}})
      {'a': {'b': 'a/b=1'}}
    """
    return jax.tree_util.tree_map_with_path(
        lambda p, *xs: fn(path_of(p), *xs), tree, *rest, is_leaf=is_leaf
    )


def compile_pattern(pattern: str | re.Pattern, *, field: str) -> re.Pattern:
    """Compiles a path regex, turning a syntax error into a message that names the field.

    Patterns are matched with ``re.search`` against '/'-joined paths.

    Example:
      >>> pattern = compile_pattern(r"attn/(q|v)/kernel", field="targets")
      >>> pattern.search("blocks/attn/q/kernel") is not None
      True
    """
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise ValueError(f"{field}: expected a regex string, got {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{field}: invalid regex {pattern!r}: {e}") from e
