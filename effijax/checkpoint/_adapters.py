"""Adapter-only checkpoints: the LoRA adapters and their optimizer state, the base by reference.

A LoRA run trains a ``TrainState`` whose ``params`` are just the adapters pytree, so its
checkpoint is an ordinary (small) :class:`~effijax.checkpoint.Checkpointer` checkpoint. The
frozen base is not copied: the step's metadata holds a *base reference*, ``{"path": where the
base came from, "fingerprint": base_fingerprint(base_params)}``, and restoring verifies that the
base the caller loaded has the same fingerprint.

The fingerprint is a sha256 over every leaf's path, dtype, shape and raw bytes (C order), in
the tree's flatten order: any change to the base (another seed, another fine-tune, a cast to
another dtype, a renamed layer) changes it, while the mesh or sharding it is loaded onto does
not. It costs one pass over the base on the host, leaf by leaf (about a second per GB).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import jax
import numpy as np

from effijax.checkpoint._checkpointer import Checkpointer, SaveResult
from effijax.errors import ConfigError
from effijax.paths import named_leaves

__all__ = [
    "base_fingerprint",
    "base_reference",
    "save_adapters_checkpoint",
    "restore_adapters_checkpoint",
]


def base_fingerprint(base_params) -> str:
    """``"sha256:<hex>"`` of a base model's parameters (paths, dtypes, shapes and bytes).

    Example:
      >>> import jax.numpy as jnp
      >>> a = base_fingerprint({"w": jnp.ones((2, 2))})
      >>> a == base_fingerprint({"w": jnp.ones((2, 2))})
      True
      >>> a == base_fingerprint({"w": jnp.zeros((2, 2))})
      False
      >>> a[:7]
      'sha256:'
    """
    h = hashlib.sha256()
    for path, leaf in named_leaves(base_params):
        host = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{path}|{host.dtype.name}|{host.shape};".encode())
        h.update(host.tobytes())
    return "sha256:" + h.hexdigest()


def base_reference(path: str | os.PathLike, base_params) -> dict:
    """The reference an adapter checkpoint stores for its base model.

    Args:
      path: where the base comes from (a run directory, a checkpoint, a safetensors file);
        informational, shown in error messages.
      base_params: the base parameters (fingerprinted with :func:`base_fingerprint`).

    Example:
      >>> import jax.numpy as jnp
      >>> sorted(base_reference("runs/base", {"w": jnp.ones(2)}))
      ['fingerprint', 'path']
    """
    return {"path": str(path), "fingerprint": base_fingerprint(base_params)}


def _check_reference(reference, field: str) -> dict:
    if not (isinstance(reference, Mapping) and isinstance(reference.get("fingerprint"), str)):
        raise ConfigError(field, reference, "expected {'path': ..., 'fingerprint': ...}; build "
                          "it with effijax.checkpoint.base_reference(path, base_params)")
    return dict(reference)


def save_adapters_checkpoint(directory: str | os.PathLike, step: int, adapters_state, *,
                             base_reference: Mapping, keep: int | None = None,
                             metadata: Mapping | None = None) -> SaveResult:
    """Saves an adapter-only state (adapters + their optimizer state) synchronously.

    Args:
      directory: the adapter checkpoint directory.
      step: the step to save under.
      adapters_state: a ``TrainState`` whose ``params`` are the adapters pytree (or any
        pytree of arrays).
      base_reference: from :func:`base_reference`; stored, not the base itself.
      keep: checkpoints to keep in ``directory``; None keeps all.
      metadata: the run's settings (JSON-able), stored alongside.

    Returns:
      The :class:`~effijax.checkpoint.SaveResult` (``reason="non_finite"``: nothing written).

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> from effijax.step import init_train_state
      >>> base = {"w": jnp.ones((4, 4))}
      >>> adapters = {"w": {"a": jnp.ones((4, 1)), "b": jnp.zeros((1, 4))}}
      >>> state = init_train_state(adapters, optax.adam(1e-3), 0)
      >>> d, ref = tempfile.mkdtemp(), base_reference("runs/base", base)
      >>> save_adapters_checkpoint(d, 7, state, base_reference=ref).saved
      True
      >>> target = jax.eval_shape(lambda: state)
      >>> from effijax.sharding import make_mesh, replicated
      >>> from effijax.checkpoint import restore_target
      >>> restored = restore_adapters_checkpoint(
      ...     d, target_state_abstract=restore_target(target, replicated(make_mesh())),
      ...     base_reference=ref)
      >>> restored.params["w"]["a"].shape
      (4, 1)
    """
    reference = _check_reference(base_reference, "base_reference")
    with Checkpointer(directory, every=1, keep=keep, async_save=False, metadata=metadata,
                      base_reference=reference) as ckpt:
        return ckpt.save(adapters_state, step=step, force=True)


def restore_adapters_checkpoint(directory: str | os.PathLike, *, target_state_abstract,
                                base_reference: Mapping, step: int | None = None):
    """Restores an adapter-only state after checking it was trained on this base.

    Args:
      directory: the adapter checkpoint directory.
      target_state_abstract: the adapters state's abstract target, every leaf with a sharding
        (:func:`~effijax.checkpoint.restore_target`).
      base_reference: :func:`base_reference` of the base the caller loaded; its fingerprint
        must equal the stored one (the paths may differ: the base may have moved).
      step: the step; default the latest.

    Returns:
      The adapters state, laid out as the target says.

    Raises:
      ConfigError: the checkpoint was saved for another base (both paths and fingerprints
        are named), or it holds no base reference.
      FileNotFoundError: no checkpoint.
    """
    given = _check_reference(base_reference, "base_reference")
    ckpt = Checkpointer(directory, every=1, keep=None, async_save=False)
    try:
        record = ckpt.metadata(step)
        stored = record.get("base_reference")
        if not isinstance(stored, dict):
            raise ConfigError("checkpoint", str(directory), f"step {record['step']} holds no "
                              "base reference: it is not an adapter checkpoint")
        if stored.get("fingerprint") != given["fingerprint"]:
            raise ConfigError(
                "base_reference", given.get("path"),
                f"the adapters in {directory} (step {record['step']}) were trained on the base "
                f"at {stored.get('path')!r} with fingerprint {stored.get('fingerprint')}, but "
                f"the base given has fingerprint {given['fingerprint']}; load the same base "
                "parameters (same model, seed and dtype) or train the adapters anew")
        return ckpt.restore(record["step"], target_state_abstract=target_state_abstract)
    finally:
        ckpt.close()
