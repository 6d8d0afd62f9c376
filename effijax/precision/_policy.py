"""Precision policies: which dtype parameters are stored in, computed in, and returned in.

A :class:`Policy` is an immutable value with three dtypes:

* ``param_dtype``: how the master parameters are stored (and updated by the optimizer);
* ``compute_dtype``: what the forward and backward passes run in (parameters are cast to it at
  the top of the step, so under FSDP the all-gathers move compute-dtype bytes);
* ``output_dtype``: what the model returns (logits, loss inputs).

Presets follow the mixed-precision recipe of Micikevicius et al. (2018): ``"bf16"`` and ``"fp16"``
keep f32 master weights; ``"fp16"`` needs loss scaling because fp16's smallest subnormal is 2^-24;
``"pure_bf16"`` stores parameters in bf16 too (half the parameter memory, updates smaller than
2^-8 of a weight are lost).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from effijax.errors import ConfigError
from effijax.precision._cast import _check_overrides, cast_floating
from effijax.precision._dtypes import parse_dtype
from effijax.precision._names import PRESET_ALIASES, PRESET_COMPUTE, PRESET_NAMES

__all__ = ["Policy", "get_policy", "parse_dtype", "PRESETS", "PRESET_ALIASES"]

_FIELD_NAMES = {
    "p": "param_dtype",
    "params": "param_dtype",
    "param": "param_dtype",
    "param_dtype": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "compute_dtype": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
    "output_dtype": "output_dtype",
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameters, computation and outputs, with optional per-path overrides.

    Attributes:
      param_dtype: storage dtype of the master parameters.
      compute_dtype: dtype of the forward/backward computation.
      output_dtype: dtype of the model's outputs.
      overrides: ``((path_regex, dtype), ...)``; a floating parameter whose '/'-joined path
        matches a regex (``re.search``, first match wins) is stored *and* computed in that dtype
        instead, e.g. ``(("ln|norm", "f32"),)`` keeps normalisation scales in f32 under
        ``pure_bf16``. Regexes and dtypes are validated at construction.

    Raises:
      ConfigError: naming the field (``compute_dtype``, ``overrides[0]``, ...) for a dtype that
        is not f32, bf16 or f16 (or one of their names), or a malformed override.

    Example:
      >>> import jax.numpy as jnp
      >>> p = Policy.from_string("params=float32,compute=bfloat16,output=float32")
      >>> p == get_policy("bf16")
      True
      >>> p.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
      dtype(bfloat16)
      >>> q = dataclasses.replace(p, overrides=(("ln", "f32"),))
      >>> out = q.cast_to_compute({"ln": jnp.ones(2), "w": jnp.ones(2)})
      >>> out["ln"].dtype.name, out["w"].dtype.name
      ('float32', 'bfloat16')
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    overrides: tuple = ()

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, name, parse_dtype(getattr(self, name), field=name))
        rules = _check_overrides(self.overrides)
        object.__setattr__(self, "overrides", tuple((p.pattern, d) for p, d in rules))

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """Parses ``"params=f32,compute=bf16,output=f32"`` (or ``"p=f32,c=bf16,o=f32"``).

        Fields left out default to float32. A bare preset name (``"bf16"``) is accepted too.

        Raises:
          ConfigError: with ``field="spec"``: an item that is not ``name=dtype``, an unknown
            field or dtype name, a field given twice, or an unknown preset.

        Example:
          >>> Policy.from_string("p=f32,c=f16,o=f32").compute_dtype
          dtype('float16')
          >>> Policy.from_string("params=f32,weights=bf16")  # doctest: +ELLIPSIS
          Traceback (most recent call last):
          effijax.errors.ConfigError: spec='params=f32,weights=bf16': unknown field 'weights'; ...
        """
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError("spec", spec, f"expected a non-empty str: a preset "
                              f"({', '.join(PRESETS)}) or {_SPEC_EXAMPLE}")
        if "=" not in spec:
            return _preset(spec, "spec")
        kwargs = {}
        for part in spec.split(","):
            if "=" not in part:
                raise ConfigError("spec", spec, f"item {part!r} is not 'name=dtype'; write e.g. "
                                  f"{_SPEC_EXAMPLE}")
            key, value = (s.strip().lower() for s in part.split("=", 1))
            if key not in _FIELD_NAMES:
                raise ConfigError("spec", spec, f"unknown field {key!r}; accepted: "
                                  f"{', '.join(sorted(_FIELD_NAMES))}")
            name = _FIELD_NAMES[key]
            if name in kwargs:
                raise ConfigError("spec", spec, f"{name} given twice")
            try:
                kwargs[name] = parse_dtype(value, field=name)
            except ConfigError as e:
                raise ConfigError("spec", spec, str(e)) from None
        return cls(**kwargs)

    def __str__(self) -> str:
        s = (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )
        return s + "".join(f" [{p}->{d.name}]" for p, d in self.overrides)

    @property
    def needs_loss_scaling(self) -> bool:
        """True when parameters or computation are float16, whose range underflows gradients."""
        f16 = np.dtype(jnp.float16)
        return self.compute_dtype == f16 or self.param_dtype == f16

    def cast_to_param(self, tree):
        """Casts floating leaves to ``param_dtype``, honouring ``overrides``."""
        return cast_floating(tree, self.param_dtype, overrides=self.overrides)

    def cast_to_compute(self, tree):
        """Casts floating leaves to ``compute_dtype``, honouring ``overrides``.

        Call it on the master parameters at the top of a step: under FSDP the cast happens on
        each shard, so the all-gathers that follow move compute-dtype bytes.
        """
        return cast_floating(tree, self.compute_dtype, overrides=self.overrides)

    def cast_to_output(self, tree):
        """Casts floating leaves to ``output_dtype`` (overrides do not apply to outputs)."""
        return cast_floating(tree, self.output_dtype)


PRESETS: dict[str, Policy] = {
    "fp32": Policy(jnp.float32, jnp.float32, jnp.float32),
    "bf16": Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    "fp16": Policy(jnp.float32, jnp.float16, jnp.float32),
    "pure_bf16": Policy(jnp.bfloat16, jnp.bfloat16, jnp.float32),
}
assert tuple(PRESETS) == PRESET_NAMES, "precision._names lists the presets"
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
assert all(_SHORT[jnp.dtype(p.compute_dtype).name] == PRESET_COMPUTE[name]
           for name, p in PRESETS.items()), "precision._names.PRESET_COMPUTE"
_SPEC_EXAMPLE = "a string like 'params=f32,compute=bf16,output=f32'"


def _preset(name: str, field: str) -> Policy:
    key = name.strip().lower()
    key = PRESET_ALIASES.get(key, key)
    if key not in PRESETS:
        raise ConfigError(field, name, f"unknown precision policy; presets: {', '.join(PRESETS)} "
                          f"(aliases: {', '.join(PRESET_ALIASES)}), or {_SPEC_EXAMPLE}")
    return PRESETS[key]


def get_policy(name: str | Policy) -> Policy:
    """Returns a preset policy by name, or parses a policy string.

    Presets: ``"fp32"``; ``"bf16"`` (f32 params, bf16 compute, f32 output); ``"fp16"`` (same with
    fp16 compute; train it with loss scaling); ``"pure_bf16"`` (bf16 params too). Case and
    surrounding spaces are ignored, and :data:`PRESET_ALIASES` (``"float32"``, ``"bfloat16"``,
    ``"half"``, ...) name the same presets.

    Raises:
      ConfigError: with ``field="name"`` for an unknown preset (the message lists the presets)
        or a value that is neither a str nor a Policy; see :meth:`Policy.from_string` for
        policy strings.

    Example:
      >>> get_policy("fp16").needs_loss_scaling
      True
      >>> str(get_policy("pure_bf16"))
      'params=bfloat16,compute=bfloat16,output=float32'
    """
    if isinstance(name, Policy):
        return name
    if not isinstance(name, str):
        raise ConfigError("name", name, f"expected a preset name ({', '.join(PRESETS)}), "
                          f"{_SPEC_EXAMPLE}, or a Policy")
    if "=" in name:
        try:
            return Policy.from_string(name)
        except ConfigError as e:  # the caller's argument is `name`, not from_string's `spec`
            raise ConfigError("name", name, e.problem) from None
    return _preset(name, "name")
