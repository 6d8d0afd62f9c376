"""The parameter matmul ``x @ w``, with a backward whose dots XLA:CPU runs on its bf16 GEMM, and
16-bit arrays carried across the layers' scan as integer bits.

XLA:CPU runs a bf16 dot on its native GEMM (YNNPACK, about twice its f32 rate) only when both
operands are bf16 and laid out row-major with the left one contracting its last axis; any other
bf16 dot it converts to f32 first and runs at the f32 rate (``benchmarks/RESULTS.md``, "XLA:CPU
matmul layouts"). Autodiff of the models' ``einsum(x, w, preferred_element_type=f32)`` misses
that form twice: the cotangent of the f32 accumulator is f32, so ``dx = dy·wᵀ`` multiplies an
f32 ``dy`` by a bf16 ``w`` (mixed operands: both go to f32), and ``dw = xᵀ·dy`` contracts ``x``
over its leading (token) axis. The forward ran at the bf16 rate, the backward (two thirds of the
matmul FLOPs) at the f32 rate.

:func:`matmul`, for 16-bit operands in a trace made for the CPU, has a hand-written backward:

* it receives the cotangent of the 16-bit output: the plain path's f32 ``dy`` is exactly this,
  upcast, so every product is the same and accumulation stays f32;
* ``dx = dy·wᵀ`` is one bf16 dot with both operands contracting their last axes, which the
  GEMM takes as it is (it packs ``w`` transposed itself);
* ``dw`` is computed only when ``w`` is differentiated (full fine-tuning, not a frozen LoRA
  base), from ``xᵀ`` materialised in the forward. A transpose XLA can turn into a layout
  change it does turn into one, and the GEMM rejects the column-major operand that results;
  ``xᵀ`` saved by the forward and read by the backward crosses the scan of the layers as a
  real row-major buffer, so the layers' weight gradients run natively. The same array is
  ``x``'s size, and ``x`` itself is no longer kept for this dot.

``transposed=True`` takes the kernel as ``w_FD`` (the tied head's embedding): the forward and
``dx`` then read it as stored, where ``embedding.T`` as a kernel would make both column-major.

Results are rounded once to the operands' dtype as before; the GEMM's summation order differs
from the f32 fallback's, so 16-bit results agree with the plain path to 16-bit rounding, not
bit for bit. f32 operands keep the plain ``dot_general`` and its autodiff (bit for bit: f32 runs
at the same rate in every layout here, and XLA's f32 weight-gradient dot sums in another order
than the row-major GEMM would), and so does every backend but the CPU: GPUs and TPUs run any
layout natively. The backend is the one the trace is made for
(:func:`~effijax.models.target_backend`), so a step exported for ``cuda`` or ``tpu`` from a CPU
host carries exactly the plain dots.

The layers' scan meets a second XLA:CPU rule: a slice, dynamic slice or dynamic update of a
stacked 16-bit array is carried out in f32 (the whole stacked buffer converted there and back).
So on the CPU 16-bit arrays cross the scan as their integer bits: :func:`keep` for the residuals
of the hand-written backwards (and :func:`kept_vjp` for attention's), :func:`freeze_kernels`
for a LoRA step's frozen kernels, which :func:`matmul` takes as :class:`Kept` bits.

Token rows: the models hand :func:`matmul` their activations as :func:`token_rows` gives them,
``[B·S, D]`` rows (a 2-D dot's backward contracts over one axis, which XLA:CPU runs fastest) or,
where the mesh's ``context`` axis splits the sequence, ``[B, S, D]`` as they are: a flattened
``b·S + s`` index is no block of the devices' sequence chunks once a device holds two or more
rows, and XLA gathered the whole sequence to flatten it. Every dot here takes either.

Shape suffixes: ``N`` token rows (flattened tokens, or the ``B, S`` axes), ``D`` input width,
``F`` output width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec as P

from effijax.models._backend import target_backend
from effijax.precision import dot
from effijax.sharding import BATCH_AXES, CONTEXT_AXIS, activation_spec

# Operand dtypes that take the CPU backward: bf16 (native GEMM) and f16 (no native GEMM here,
# but the same exact 16-bit cotangent, and no mixed-dtype dot).
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def materialize(x: jax.Array) -> jax.Array:
    """``x`` as its own buffer: keeps XLA from folding a transpose into the dot that reads it.

    Example:
      >>> import jax.numpy as jnp
      >>> materialize(jnp.arange(6).reshape(2, 3).T).shape
      (3, 2)
    """
    return jax.lax.optimization_barrier(x)


def _context_degree() -> int:
    """The size of the ``context`` axis of the mesh set by ``jax.set_mesh`` (1: no mesh, or
    no such axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def token_rows(x: jax.Array) -> jax.Array:
    """``x`` as the token rows :func:`matmul` takes: its leading axes flattened to one
    (``[B, S, D] -> [B·S, D]``), unless the mesh set by ``jax.set_mesh`` has a ``context``
    axis above 1, where ``x`` stays ``[B, S, ...]``. The sequence is split along that axis, and
    with two or more rows per device the flattened ``b·S + s`` index is no block of the
    devices' chunks: XLA all-gathered the sequence to flatten it (twice the activations of the
    tiny GPT's step at batch 2 x 512 on ``context=4``: 11.6 MB against 5.4 MB). There
    the batch and sequence axes are pinned to :func:`~effijax.sharding.activation_spec`
    without sequence parallelism (the sequence over ``context`` alone; the trailing axes left
    to XLA), the layout the flattening gave: left free, XLA kept a ``(context, tensor)``
    sequence split into the projections and resharded inside ring attention's skipped pairs,
    collectives that only some devices reached (a deadlock on ``context=2, tensor=4``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.sharding import make_mesh
      >>> x = jnp.ones((2, 8, 3))
      >>> token_rows(x).shape
      (16, 3)
      >>> with jax.set_mesh(make_mesh(context=2, devices=jax.devices()[:2])):
      ...     jax.jit(token_rows)(x).shape
      (2, 8, 3)
    """
    if x.ndim <= 2:
        return x
    if _context_degree() == 1:
        return x.reshape(-1, x.shape[-1])
    mesh = jax.sharding.get_abstract_mesh()
    if not any(a in mesh.axis_names for a in BATCH_AXES):
        return x
    spec = activation_spec(x.shape, dict(mesh.shape), sequence_parallel=False)
    return jax.lax.with_sharding_constraint(
        x, P(*spec, *(P.UNCONSTRAINED,) * (x.ndim - len(spec))))


def cpu_layout(dtype) -> bool:
    """Whether :func:`matmul` of ``dtype`` operands takes the CPU backward: 16-bit operands in a
    trace made for the CPU (:func:`~effijax.models.target_backend`).

    Example:
      >>> import jax.numpy as jnp
      >>> from effijax.models import attention_backend
      >>> cpu_layout(jnp.bfloat16), cpu_layout(jnp.float32)
      (True, False)
      >>> with attention_backend("cuda"):
      ...     cpu_layout(jnp.bfloat16)
      False
    """
    return target_backend() == "cpu" and jnp.dtype(dtype) in _HALF


@jax.tree_util.register_pytree_node_class
class Kept:
    """A 16-bit float array held as its integer bits (``uint16``) and its dtype (static)."""

    def __init__(self, bits: jax.Array, dtype):
        self.bits, self.dtype = bits, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    @property
    def ndim(self) -> int:
        return self.bits.ndim

    def tree_flatten(self):
        return (self.bits,), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(children[0], dtype)


def keep(x: jax.Array | None):
    """``x`` as a residual a hand-written backward reads: a 16-bit float array in a trace made
    for the CPU becomes :class:`Kept` bits (the same bytes, nothing rounded); anything else is
    returned as it is. :func:`unkeep` gives the array back.

    Why: a scan stacks the residuals of each layer for the backward, one dynamic update per
    layer. XLA:CPU carries out a dynamic update of a bf16 array in f32, converting the whole
    stacked buffer there and back at every layer: an O(L²) copy, measured at a quarter of
    SmolLM2's bf16 LoRA step. A dynamic update of integers is done in place.

    Example:
      >>> import jax.numpy as jnp
      >>> kept = keep(jnp.full(2, 1.5, jnp.bfloat16))
      >>> kept.bits.dtype, unkeep(kept).tolist()
      (dtype('uint16'), [1.5, 1.5])
      >>> keep(jnp.ones(2)).dtype  # f32 is kept as it is
      dtype('float32')
    """
    if x is None or jnp.dtype(x.dtype) not in _HALF or target_backend() != "cpu":
        return x
    return Kept(jax.lax.bitcast_convert_type(x, jnp.uint16), x.dtype)


def kept_shapes(tree):
    """``tree`` with each :class:`Kept` leaf as the ``jax.ShapeDtypeStruct`` of its array (for
    checks that read shapes and dtypes).

    Example:
      >>> import jax.numpy as jnp
      >>> kept_shapes({"k": keep(jnp.ones(2, jnp.bfloat16))})["k"].dtype
      dtype(bfloat16)
    """
    return jax.tree.map(lambda k: jax.ShapeDtypeStruct(k.shape, k.dtype)
                        if isinstance(k, Kept) else k, tree,
                        is_leaf=lambda n: isinstance(n, Kept))


def unkeep(residual):
    """The array :func:`keep` made ``residual`` from (``residual`` itself when it is not
    :class:`Kept`).

    Example:
      >>> import jax.numpy as jnp
      >>> unkeep(None) is None
      True
    """
    if isinstance(residual, Kept):
        return jax.lax.bitcast_convert_type(residual.bits, residual.dtype)
    return residual


def kept_vjp(fn):
    """``fn`` with its own autodiff backward, whose saved 16-bit arrays are :func:`keep`-ed
    (integer bits on the CPU): for a function of activations only, such as attention's
    scores, softmax and weighted sum, whose residuals a scan of the layers would otherwise
    stack through f32 (see :func:`keep`). The same arithmetic; elsewhere a no-op wrapper.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = kept_vjp(lambda x, y: (x * y).astype(jnp.float32).sum())
      >>> x = jnp.full(3, 2.0, jnp.bfloat16)
      >>> jax.grad(f)(x, x).tolist()
      [2.0, 2.0, 2.0]
    """

    @jax.custom_vjp
    def wrapped(*args):
        return fn(*args)

    def fwd(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, jax.tree.map(keep, vjp)

    def bwd(residuals, cotangent):
        return jax.tree.map(unkeep, residuals, is_leaf=lambda n: isinstance(n, Kept))(cotangent)

    wrapped.defvjp(fwd, bwd)
    return wrapped


def matmul(x_ND: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """``x @ w`` (``x @ wᵀ`` with ``transposed``) with f32 accumulation, in ``x``'s dtype, with
    the CPU backward for 16-bit operands (see the module docstring).

    Args:
      x_ND: activations: token rows (:func:`token_rows`), 2-D or ``[B, S, D]``.
      w: the kernel ``w_DF`` of ``x``'s dtype, or ``w_FD`` with ``transposed=True``.
      transposed: the kernel is stored (out, in), like a tied head's embedding.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x, w = jnp.ones((4, 3), jnp.bfloat16), jnp.ones((3, 2), jnp.bfloat16)
      >>> matmul(x, w).dtype, matmul(x, w.T, transposed=True).shape
      (dtype(bfloat16), (4, 2))
      >>> dx, dw = jax.grad(lambda x, w: matmul(x, w).astype(jnp.float32).sum(), (0, 1))(x, w)
      >>> dx.tolist()[0], dw.tolist()[0]
      ([2.0, 2.0, 2.0], [4.0, 4.0])
    """
    if isinstance(w, Kept):  # a frozen kernel held as bits (freeze_kernels)
        return _kept_matmul(x_ND, w.bits, transposed, w.dtype)
    if not cpu_layout(x_ND.dtype):
        return dot("...d,fd->...f" if transposed else "...d,df->...f", x_ND, w)
    return _cpu_matmul(x_ND, w, transposed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cpu_matmul(x_ND: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    return dot("...d,fd->...f" if transposed else "...d,df->...f", x_ND, w)


def _cpu_matmul_fwd(x_ND, w, transposed):
    # symbolic_zeros: the primals arrive with ``perturbed``. Keep only what the backward reads:
    # the kernel for dx, xᵀ for dw (None when that input is not differentiated).
    x, kernel = x_ND.value, w.value
    y_NF = dot("...d,fd->...f" if transposed else "...d,df->...f", x, kernel)
    x_DN = keep(materialize(jnp.moveaxis(x, -1, 0))) if w.perturbed else None
    return y_NF, (x_DN, kernel if x_ND.perturbed else None)


def _cpu_matmul_bwd(transposed, residuals, dy_NF):
    x_DN, kernel = unkeep(residuals[0]), residuals[1]
    if isinstance(dy_NF, SymbolicZero):
        return None, None
    dx_ND = None
    if kernel is not None:  # both forms contract dy's last axis: the GEMM's own
        dx_ND = dot("...f,fd->...d" if transposed else "...f,df->...d", dy_NF, kernel)
    dw = None
    if x_DN is not None:
        dw_DF = dot("d...,...f->df", x_DN, dy_NF)
        dw = dw_DF.T if transposed else dw_DF
    return dx_ND, dw


_cpu_matmul.defvjp(_cpu_matmul_fwd, _cpu_matmul_bwd, symbolic_zeros=True)


# A frozen kernel's matmul from its bits: the backward computes dx only, from the kernel's bits
# as the step received them (the scan's own slice, which it forwards instead of stacking a copy).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _kept_matmul(x_ND: jax.Array, bits: jax.Array, transposed: bool, dtype) -> jax.Array:
    kernel = jax.lax.bitcast_convert_type(bits, dtype)
    return dot("...d,fd->...f" if transposed else "...d,df->...f", x_ND, kernel)


def _kept_matmul_fwd(x_ND, bits, transposed, dtype):
    return _kept_matmul(x_ND, bits, transposed, dtype), bits


def _kept_matmul_bwd(transposed, dtype, bits, dy_NF):
    kernel = jax.lax.bitcast_convert_type(bits, dtype)
    return dot("...f,fd->...d" if transposed else "...f,df->...d", dy_NF, kernel), None


_kept_matmul.defvjp(_kept_matmul_fwd, _kept_matmul_bwd)


def freeze_kernels(base):
    """A frozen base as a LoRA step uses it: no gradient reaches it (``stop_gradient``), and in
    a trace made for the CPU its 16-bit ``kernel`` leaves are held as :class:`Kept` bits, which
    every parameter matmul (:func:`matmul`) takes. XLA:CPU slices a stacked bf16 kernel through
    f32 (see :func:`keep`): it converted SmolLM2's whole bf16 base to f32 and back at every
    step; bits are sliced as they are, and the backward reads the scan's own slice.

    Example:
      >>> import jax.numpy as jnp
      >>> base = freeze_kernels({"q": {"kernel": jnp.ones((2, 3, 3), jnp.bfloat16)},
      ...                        "norm": {"scale": jnp.ones(3, jnp.bfloat16)}})
      >>> type(base["q"]["kernel"]).__name__, base["norm"]["scale"].dtype
      ('Kept', dtype(bfloat16))
    """
    base = jax.lax.stop_gradient(base)
    if target_backend() != "cpu":
        return base

    def freeze(path, leaf):
        named = getattr(path[-1], "key", None) == "kernel" if path else False
        return keep(leaf) if named and isinstance(leaf, jax.Array) else leaf

    return jax.tree_util.tree_map_with_path(freeze, base)
