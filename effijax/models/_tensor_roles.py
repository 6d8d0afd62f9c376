"""Which weights a model splits over the ``tensor`` axis, read off its modules' roles.

A module declares the role of each dense child it owns as ``tensor_roles``: ``{child: (input
name, output name)}`` in logical dimension names (:data:`effijax.sharding.TENSOR_SPLIT`):

* :class:`~effijax.models._decoder.Attention` (and every subclass: rotary, Gemma's) declares
  its q/k/v projections ``("embed", "heads")``/``("embed", "kv")`` (column-parallel) and
  its output projection ``("heads", "embed")`` (row-parallel), from its spec's names;
* a family's MLP declares its input kernels ``("embed", "mlp")`` and its output kernel
  ``("mlp", "embed")`` as a class attribute (the GPT's ``fc_in``/``fc_out``, the Llama's
  ``gate_proj``/``up_proj``/``down_proj``);
* the decoder adds the token embedding ``("vocab", "embed")`` and an untied head
  ``("embed", "vocab")``.

:func:`tensor_layout` walks the abstract module and writes each kernel's names (its stack
axes are ``layers``) and each bias's (the output's name), so a new family gets Megatron's
layout by declaring the same roles. Norms, positions and anything else undeclared stay
replicated over ``tensor``.
"""

from __future__ import annotations

from flax import nnx

from effijax.sharding import TensorLayout

__all__ = ["attention_roles", "tensor_layout"]


def attention_roles(names: tuple[str, str, str, str]) -> dict[str, tuple[str, str]]:
    """The roles of an attention's q, k, v, o projections (named ``names``).

    Example:
      >>> attention_roles(("q", "k", "v", "o"))["o"]
      ('heads', 'embed')
    """
    q, k, v, o = names
    return {q: ("embed", "heads"), k: ("embed", "kv"), v: ("embed", "kv"),
            o: ("heads", "embed")}


def _names(leaf, din, dout):
    lead = ("layers",) * (leaf.ndim - (2 if din is not None else 1))
    return lead + ((din, dout) if din is not None else (dout,))


def tensor_layout(config, graphdef: nnx.GraphDef, abstract: dict, tied: bool
                  ) -> TensorLayout:
    """The :class:`~effijax.sharding.TensorLayout` of a decoder from its modules' roles.

    Args:
      config: the model (its ``shape()`` gives the head, MLP and vocabulary counts).
      graphdef, abstract: the module's structure and abstract parameters
        (:func:`~effijax.models.abstract_split`).
      tied: the head is the token embedding (no ``lm_head``).

    Example:
      >>> from effijax.models import abstract_split, llama_config
      >>> model = llama_config("llama-tiny")
      >>> layout = tensor_layout(model, *abstract_split(model), tied=False)
      >>> layout.names_of("layers/attn/k_proj/kernel"), layout.sizes["kv"]
      (('layers', 'embed', 'kv'), 2)
    """
    module = nnx.merge(graphdef, abstract)
    dims = {"embed/embedding": ("vocab", "embed")}
    if not tied:
        dims["lm_head/kernel"] = ("embed", "vocab")
    for path, node in nnx.iter_graph(module):
        roles = getattr(node, "tensor_roles", None) if isinstance(node, nnx.Module) else None
        for child, (din, dout) in (roles or {}).items():
            dense = getattr(node, child)
            prefix = "/".join(str(p) for p in (*path, child))
            dims[f"{prefix}/kernel"] = _names(dense.kernel, din, dout)
            if hasattr(dense, "bias"):
                dims[f"{prefix}/bias"] = _names(dense.bias, None, dout)
    shape = config.shape()
    sizes = {"heads": shape.heads, "kv": shape.kv_heads, "mlp": shape.ffn,
             "vocab": shape.vocab}
    return TensorLayout(dims=tuple(sorted(dims.items())), sizes=sizes, model=config.name)
