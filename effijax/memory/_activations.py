"""Activation memory of a transformer stack: what the forward pass keeps for the backward pass.

Per layer, with s sequence length, b (micro-)batch, h hidden size, a heads, p bytes per value
(masks are 1 byte per value), the terms are those of Korthikanti et al. (2022) as the seed
"LLM Training Acceleration" derives them:

    MLP        9psbh + sbh        (4h up-projection, 4h GeLU output, h down-projection, mask)
    attention  5psbh + sbh        (3h q/k/v, h attention output, h projection, mask)
               + 2pas²b + as²b    (softmax input and output, attention-dropout mask)
    norms      2psbh

    total = L·p·s·b·h·(16 + 2/p + 2as/h + as/(p·h))

Switches remove or replace exactly the terms they affect (see :func:`activation_bytes`).
Embeddings, the final norm and the logits are not counted, as in Korthikanti et al., unless
``vocab`` is given. effijax's models compute the output head and the cross-entropy together in
chunks of ``c`` positions (:mod:`effijax.models._head`), so what they add is one chunk's f32
logits, ``4·c·b·V``, and the hidden states' gradient the forward keeps, ``p·s·b·h``, where a
loss of whole logits keeps ``4·s·b·V``.

Context parallelism over ``n`` devices (a mesh's ``context`` axis, ring attention:
:func:`effijax.models.context_attend`) splits every row's sequence: each device keeps ``s/n``
positions of every term above (on top of the tensor split). The attention is the ring's
whatever the model's setting: blockwise, never ``s x s`` scores, and its residuals add the
merged output in f32 beside the ``p``-byte one when ``p < 4``, ``4·(s/n)·b·q``. What stays
whole on every device is the fused head and loss, which run after the trunk on the whole
sequence (the model puts it back in order): the logits chunk and the final hidden states'
gradient above. The ring's travelling K/V shard and its f32 ``dK, dV`` live only inside one
layer's backward and are not kept, as the formula counts no layer's transients.

Llama-family layers generalise the linear terms (Ainslie et al. 2023 grouped-query attention,
Shazeer 2020 SwiGLU): with query width ``q = a·d_head``, key/value width ``k = a_kv·d_head`` and
MLP width ``f``, a layer keeps ``p·s·b·(h + 2q + 2k)`` for attention (the projections' input,
Q, K, V and the attention output), ``p·s·b·(h + 2f)`` for a GeLU MLP or ``p·s·b·(h + 3f)`` for
a gated one (gate, up and their product), and ``2psbh`` for the norms. With ``q = k = h`` and
``f = 4h`` this is the 16psbh above.

Tensor parallelism over ``t`` devices (Megatron's layout, Korthikanti et al. section 4.2.1)
splits what lives inside the attention and MLP regions: Q, K, V (K and V only when ``t``
divides the key/value heads, else each device holds all of them), the attention output, the
MLP's inner activations and the scores, but keeps whole on every device the block inputs, the
norms and the dropout masks: per layer ``sbh(10 + 24/t + 5as/(ht))`` for the formula above.
Sequence parallelism (``sequence_parallel=True``) splits that remainder along the sequence:
``sbh(34/t + 5as/(ht))``. The vocabulary-parallel chunk of logits is ``4cbV/t``. Gemma 3's
sandwich norms (``sandwich_norms``: a norm after the attention and after the MLP too, and one
on every query and key head) keep their inputs as well: ``p·s·b·(2h + q + k)`` more (the query
and key norms' inside the tensor-parallel regions, the other two outside). (Its GeGLU keeps
what SwiGLU keeps: gate, up, product.)
"""

from __future__ import annotations

import dataclasses

from effijax.errors import ConfigError, whole_number
from effijax.memory._estimate import _check_choice
from effijax.precision import loss_chunk_positions
from effijax.sharding import CONTEXT_AXIS, check_context

__all__ = ["CHECKPOINTING", "activation_bytes"]

CHECKPOINTING = ("none", "block")


@dataclasses.dataclass(frozen=True)
class _LayerTerms:
    """Bytes per layer, term by term, for one micro-batch."""

    linear: int  # 16psbh: every p-byte tensor of width h or 4h (MLP, q/k/v, outputs, norms)
    masks: int  # 2sbh: the two 1-byte dropout masks after the MLP and the attention projection
    scores: int  # 2pas²b: softmax input and output
    score_mask: int  # as²b: 1-byte attention-dropout mask
    softmax_stats: int  # 8asb: blockwise attention's f32 row max and denominator per head
    ring_output: int = 0  # 4sbq: ring attention's f32 merged output, when p < 4

    @property
    def total(self) -> int:
        return (self.linear + self.masks + self.scores + self.score_mask + self.softmax_stats
                + self.ring_output)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One transformer layer at one micro-batch: everything its activations depend on, checked.

    The planner keeps one and changes ``batch_size`` with ``dataclasses.replace`` as it tries
    smaller micro-batches; :func:`activation_bytes` builds one from its arguments.
    """

    hidden: int
    heads: int
    seq_len: int
    batch_size: int
    bytes_per_value: int
    dropout: bool
    blockwise_attention: bool
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn: int | None = None
    gated_mlp: bool = False
    tensor: int = 1
    sequence_parallel: bool = False
    sandwich_norms: bool = False
    context: int = 1

    def terms(self) -> _LayerTerms:
        p, s, b, h, a = self.bytes_per_value, self.seq_len, self.batch_size, self.hidden, self.heads
        # Inside the regions: split over the tensor degree and, with a context axis, along the
        # sequence too; outside: see _outside.
        t, n = self.tensor * self.context, self.context
        kv_heads = a if self.kv_heads is None else self.kv_heads
        d_head = h // a if self.head_dim is None else self.head_dim
        q, k = a * d_head, kv_heads * d_head
        f = 4 * h if self.ffn is None else self.ffn
        # Inside the tensor-parallel regions (split over t): Q, attention output, K and V when
        # the kv heads split, the MLP's inner activations. Outside: the attention's and the
        # MLP's inputs and the two norms (split only by sequence parallelism).
        inside = 2 * q + (3 if self.gated_mlp else 2) * f
        outside = h + h + 2 * h
        if self.sandwich_norms:  # the norms after attention and MLP; on the q and k heads
            inside, outside = inside + q, outside + 2 * h
        kv_values = (3 if self.sandwich_norms else 2) * k
        if kv_heads % self.tensor == 0:
            inside += kv_values
        else:
            outside += kv_values
        # A context axis runs ring attention: blockwise whatever the setting.
        dropout, blockwise = self.dropout, self.blockwise_attention or n > 1
        return _LayerTerms(
            linear=_split(p * s * b * inside, t) + self._outside(p * s * b * outside),
            masks=self._outside(2 * s * b * h) if dropout else 0,
            scores=0 if blockwise else _split(2 * p * a * s * s * b, t),
            score_mask=_split(a * s * s * b, t) if dropout and not blockwise else 0,
            softmax_stats=_split(2 * 4 * a * s * b, t) if blockwise else 0,
            ring_output=_split(4 * s * b * q, t) if n > 1 and p < 4 else 0,
        )

    def _outside(self, nbytes: int) -> int:
        """Bytes outside the tensor-parallel regions: whole, or split by the sequence (over
        the tensor degree with sequence parallelism, over the context axis)."""
        return _split(self._tensor_outside(nbytes), self.context)

    def _tensor_outside(self, nbytes: int) -> int:
        """``nbytes`` whole, or split over the tensor degree with sequence parallelism."""
        return _split(nbytes, self.tensor) if self.sequence_parallel else nbytes

    def input_bytes(self) -> int:
        """A block's input, p·s·b·h: what block checkpointing keeps of each layer."""
        return self._outside(self.bytes_per_value * self.seq_len * self.batch_size * self.hidden)

    def logits_bytes(self, vocab: int | None) -> int:
        """The output head fused with its loss (0 when ``vocab`` is None: not counted): one
        chunk's f32 logits, 4·c·b·V/t (``c`` positions, :func:`~effijax.precision.
        loss_chunk_positions`), and the gradient of the final hidden states the forward
        forms for the backward, p·s·b·h. Not split by a context axis: the head and the loss
        run on the whole sequence."""
        if vocab is None:
            return 0
        s, b = self.seq_len, self.batch_size
        chunk = _split(4 * loss_chunk_positions(b, s) * b * vocab, self.tensor)
        return chunk + self._tensor_outside(self.bytes_per_value * s * b * self.hidden)


def _split(nbytes: int, t: int) -> int:
    """One device's share of ``nbytes`` split ``t`` ways (rounded up)."""
    return -(-nbytes // t)


def _check_layer_options(heads: int, kv_heads, head_dim, ffn, vocab) -> None:
    """The optional widths, whole and positive; ``kv_heads`` groups ``heads`` evenly.

    Sizes here only enter Python's exact arithmetic, never a device: no int32 bound.
    """
    for name, value in (("kv_heads", kv_heads), ("head_dim", head_dim), ("ffn", ffn),
                        ("vocab", vocab)):
        whole_number(name, value, maximum=None, none=True)
    if kv_heads is not None and heads % kv_heads:
        raise ConfigError("kv_heads", kv_heads, f"must divide heads={heads} (each key/value "
                          "head serves a whole group of query heads)")


def _check_tensor(tensor: int, heads: int, sequence_parallel: bool) -> None:
    """The tensor degree is whole and divides the query heads (each device computes whole
    heads); sequence parallelism is a bool."""
    whole_number("tensor", tensor, maximum=None)
    if heads % tensor:
        raise ConfigError("tensor", tensor, f"must divide heads={heads} (each device computes "
                          "whole attention heads)")
    if not isinstance(sequence_parallel, bool):
        raise ConfigError("sequence_parallel", sequence_parallel, "expected True or False")


def _check_context(context: int, seq_len: int, dropout: bool) -> int:
    """The context degree: whole, its ``2 x context`` load-balanced chunks dividing
    ``seq_len``, and no dropout (ring attention has none); the rule a model on a context mesh
    passes (:func:`effijax.sharding.check_context`)."""
    whole_number("context", context, maximum=None)
    return check_context({CONTEXT_AXIS: context}, seq_len, dropout=bool(dropout))


def _stack_bytes(layer: _Layer, layers: int, checkpointing: str, vocab: int | None) -> int:
    """Bytes kept by ``layers`` copies of ``layer`` (and the logits) under ``checkpointing``."""
    kept = layers * layer.terms().total
    if checkpointing == "block":
        # Every block's input, and one block's full activations while it is recomputed.
        kept = layers * layer.input_bytes() + layer.terms().total
    return kept + layer.logits_bytes(vocab)


def activation_bytes(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq_len: int,
    batch_size: int,
    bytes_per_value: int = 2,
    dropout: bool = True,
    checkpointing: str = "none",
    blockwise_attention: bool = False,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    ffn: int | None = None,
    gated_mlp: bool = False,
    vocab: int | None = None,
    tensor: int = 1,
    sequence_parallel: bool = False,
    sandwich_norms: bool = False,
    context: int = 1,
) -> int:
    """Bytes of activations kept for the backward pass, on one device, for one micro-batch.

    With the defaults this is exactly ``L·p·s·b·h·(16 + 2/p + 2as/h + as/(p·h))`` (Korthikanti
    et al. 2022, with p bytes per value).

    * ``dropout=False`` removes the three 1-byte dropout masks: 2sbh + as²b per layer.
    * ``blockwise_attention=True`` (flash attention) never stores the s x s scores: it drops the
      softmax input and output (2pas²b) and their dropout mask (as²b, regenerated from the RNG
      seed), and instead keeps the online-softmax statistics of every query row and head, the
      running max m and denominator d (Milakov & Gimelshein 2018), in f32: 2·4·a·s·b bytes.
      (FlashAttention-2 keeps only their log-sum-exp, 4·a·s·b; this counts both.)
    * ``checkpointing="block"`` keeps only each block's input, p·s·b·h per layer, and recomputes
      one block at a time in the backward pass, whose full activations (one layer's worth of the
      above) are added once: L·psbh + (one layer).

    Args:
      layers: transformer blocks L.
      hidden: hidden size h.
      heads: attention heads a.
      seq_len: sequence length s.
      batch_size: sequences per device per micro-batch b.
      bytes_per_value: p, bytes of an activation value (2 for bf16/fp16, 4 for f32).
      dropout: whether dropout masks are stored.
      checkpointing: ``"none"`` or ``"block"``.
      blockwise_attention: flash/blockwise attention instead of materialized scores.
      kv_heads: key/value heads under grouped-query attention (default ``heads``).
      head_dim: width of one head (default ``hidden // heads``).
      ffn: MLP hidden width (default ``4 * hidden``).
      gated_mlp: a gated MLP (SwiGLU: gate, up, down) instead of up, GeLU, down.
      vocab: count the output head fused with its loss: one chunk's f32 logits,
        ``4·c·b·vocab`` bytes, and the final hidden states' gradient, ``p·s·b·h`` (default:
        not counted, as in Korthikanti et al.'s formula).
      tensor: the tensor-parallel degree ``t``: the regions inside the attention and the MLP
        are split ``t`` ways, the rest stays whole (see the module docstring); must divide
        ``heads``.
      sequence_parallel: split the rest along the sequence too (Korthikanti et al.'s ``34/t``).
      sandwich_norms: Gemma 3's norms after the attention and the MLP and on the query and key
        heads, whose inputs are kept too: ``p·s·b·(2h + q + k)`` more per layer.
      context: the context-parallel degree ``n`` (a mesh's ``context`` axis): every layer's
        terms (and the block inputs) split ``n`` ways along the sequence, the attention
        counted as the ring's (blockwise, plus its f32 output when ``p < 4``); the head and
        loss (``vocab``) stay whole. ``2n`` must divide ``seq_len`` (the load-balanced
        chunks), and ``dropout`` be False (ring attention has none).

    Returns:
      The number of bytes (an exact integer).

    Raises:
      ConfigError: naming the argument, for non-positive sizes or an unknown ``checkpointing``,
        a ``seq_len`` a context degree does not split, or dropout with a context degree.

    Example:
      >>> # 32 x 2·2048·1·4096 x (16 + 2/2 + 2·32·2048/4096 + 32·2048/(2·4096))
      >>> activation_bytes(layers=32, hidden=4096, heads=32, seq_len=2048, batch_size=1)
      30601641984
      >>> activation_bytes(layers=32, hidden=4096, heads=32, seq_len=2048, batch_size=1,
      ...                  checkpointing="block", blockwise_attention=True)
      822607872
      >>> # Llama-2-70B's shape: 8 key/value heads of 64 query heads, SwiGLU of width 28672.
      >>> activation_bytes(layers=80, hidden=8192, heads=64, seq_len=4096, batch_size=1,
      ...                  dropout=False, kv_heads=8, ffn=28672, gated_mlp=True)
      433523261440
      >>> # Tensor parallel over 8: 32 x 2048·4096 x (10 + 24/8 + 5·32·2048/(4096·8))
      >>> activation_bytes(layers=32, hidden=4096, heads=32, seq_len=2048, batch_size=1,
      ...                  tensor=8)
      6174015488
      >>> activation_bytes(layers=32, hidden=4096, heads=32, seq_len=2048, batch_size=1,
      ...                  tensor=8, sequence_parallel=True)  # 34/8 instead of 10 + 24/8
      3825205248
      >>> # A context axis of 8: each device keeps 1/8 of the sequence's (blockwise) terms;
      >>> # the head and loss (32000-word vocabulary) stay whole.
      >>> one = activation_bytes(layers=32, hidden=4096, heads=32, seq_len=32768, batch_size=1,
      ...                        dropout=False, blockwise_attention=True, vocab=32000)
      >>> eight = activation_bytes(layers=32, hidden=4096, heads=32, seq_len=32768,
      ...                          batch_size=1, dropout=False, vocab=32000, context=8)
      >>> head = 4 * 512 * 32000 + 2 * 32768 * 4096  # one logits chunk + the hidden gradient
      >>> eight - head == (one - head) // 8 + 32 * 4 * 32768 * 4096 // 8  # + the f32 outputs
      True
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("seq_len", seq_len), ("batch_size", batch_size),
                        ("bytes_per_value", bytes_per_value)):
        whole_number(name, value, maximum=None)
    checkpointing = _check_choice("checkpointing", checkpointing, CHECKPOINTING)
    _check_layer_options(heads, kv_heads, head_dim, ffn, vocab)
    _check_tensor(tensor, heads, sequence_parallel)
    context = _check_context(context, seq_len, dropout)
    layer = _Layer(hidden, heads, seq_len, batch_size, bytes_per_value, dropout,
                   blockwise_attention, kv_heads, head_dim, ffn, gated_mlp, tensor,
                   bool(sequence_parallel), sandwich_norms, context)
    return _stack_bytes(layer, layers, checkpointing, vocab)
