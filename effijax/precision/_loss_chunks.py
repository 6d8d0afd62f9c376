"""How the output head fused with its loss splits a batch: the one rule behind the fused loss
(:mod:`effijax.models._head`) and the memory estimate of its logits (:mod:`effijax.memory`).
Plain Python: a config's validation and the memory estimate import it without JAX."""

from __future__ import annotations

# Tokens per chunk of a loss computed in chunks with its head (effijax.models._head). SmolLM2's
# head and loss, forward + backward of 2,048 tokens on a 2-core CPU: chunks of 256 and 512
# tokens the fastest (f32 1.95 -> 1.57 s, bf16 1.77 -> 1.01 s against the whole logits at
# once); 64 slower than the whole.
LOSS_CHUNK_TOKENS = 512


def loss_chunk_positions(batch: int, seq: int) -> int:
    """Sequence positions per chunk of the head fused with its loss (all ``batch`` rows of
    each): the longest divisor of ``seq`` whose chunk holds at most :data:`LOSS_CHUNK_TOKENS`
    tokens; the whole sequence when that chunk would hold under a quarter of them (a prime
    length, say: many tiny matmuls cost more than one large one). The one rule behind the
    fused loss and the memory estimate of its logits.

    Example:
      >>> loss_chunk_positions(4, 512), loss_chunk_positions(2, 100), loss_chunk_positions(4, 509)
      (128, 100, 509)
    """
    most = max(LOSS_CHUNK_TOKENS // batch, 1)
    c = max(d for d in range(1, min(most, seq) + 1) if seq % d == 0)
    return seq if 4 * batch * c < min(LOSS_CHUNK_TOKENS, batch * seq) else c
