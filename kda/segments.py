"""KDA over a long sequence in segments, each recomputed in the backward: memory for T = 1M.

A differentiated `kda_attention` keeps, for its backward, per-chunk residuals of the whole
sequence (the state entering every 64-token chunk, float32 [B, HV, T/64, K, V], and the chunk
preparation's tiles), and the backward adds state cotangents of the same size: at T = 1,048,576
with 16 heads of 128, about 17 GiB each on top of the inputs and their gradients.

Cut into S segments of `segment_tokens` tokens, the recurrence runs segment after segment under
`lax.scan`, the state S_s [B, HV, K, V] carried between them:

    o_s, S_s = kda_attention(q_s, k_s, v_s, g_s, beta_s, initial_state=S_{s-1})

which is the same computation (the chunked algorithm already cuts the sequence at chunk
boundaries; a segment boundary is one of them). Each segment's body is a `jax.checkpoint`: the
forward saves only the carried states (S float32 [B, HV, K, V] arrays), and the backward,
segment by segment from the last, recomputes that segment's forward with its residuals and
runs its VJP. Memory for residuals falls from the whole sequence's to one segment's; the price
is one more forward pass.

Packed documents: a segment whose first token starts a new document (its id differs from the
previous token's) starts from the zero state, as the unsegmented op does at a document start.
"""

import jax
import jax.numpy as jnp
from jax import lax

from kda.api import kda_attention
from kda.chunked import CHUNK_SIZE


def is_segment_size(segment_tokens) -> bool:
    """Whether `segment_tokens` can cut sequences into segments: an int, a positive multiple of
    the 64-token chunk (so that segment boundaries are chunk boundaries)."""
    return (isinstance(segment_tokens, int) and not isinstance(segment_tokens, bool)
            and segment_tokens >= CHUNK_SIZE and segment_tokens % CHUNK_SIZE == 0)


def _to_segments(x: jax.Array, num_segments: int) -> jax.Array:
    """[B, S Ts, ...] -> [S, B, Ts, ...] (a reshape, and for B > 1 a transpose)."""
    batch, length = x.shape[:2]
    x = x.reshape(batch, num_segments, length // num_segments, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _from_segments(x: jax.Array) -> jax.Array:
    """[S, B, Ts, ...] -> [B, S Ts, ...]."""
    num_segments, batch, length = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(batch, num_segments * length, *x.shape[3:])


def segment_starts_document(segment_ids: jax.Array, segment_tokens: int) -> jax.Array:
    """bool [S, B]: segment s's first token begins a new document (never for s = 0, which
    continues from the initial state).

    segment_ids: integer [B, S Ts].
    """
    firsts = segment_ids[:, segment_tokens::segment_tokens]  # [B, S-1]
    previous = segment_ids[:, segment_tokens - 1:-1:segment_tokens]  # [B, S-1]
    starts = jnp.concatenate([jnp.zeros((segment_ids.shape[0], 1), bool), firsts != previous],
                             axis=1)
    return starts.T


def kda_attention_in_segments(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    segment_tokens: int,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    **options,
) -> tuple[jax.Array, jax.Array | None]:
    """`kda.kda_attention` in segments of `segment_tokens` tokens, each recomputed in the
    backward (module docstring): the same outputs and gradients up to float32 rounding.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV].
      segment_tokens: Ts, a positive multiple of 64 that divides T.
      initial_state: float32 [B, HV, K, V] or None (zeros).
      output_final_state: also return the state after the last token.
      segment_ids: integer [B, T] for packed documents, or None.
      options: the other keyword arguments of `kda_attention` (scale, use_qk_l2norm,
        gate_lower_bound, impl), the same for every segment.
    Returns:
      (o [B, T, HV, V], final_state float32 [B, HV, K, V] or None).
    """
    batch, length = q.shape[:2]
    if not is_segment_size(segment_tokens) or length % segment_tokens:
        raise ValueError(
            f"segment_tokens must be a positive multiple of 64 that divides the sequence length "
            f"T = {length}, got {segment_tokens!r}"
        )
    num_segments = length // segment_tokens
    state = initial_state
    if state is None:
        state = jnp.zeros((batch, v.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    inputs = tuple(_to_segments(x, num_segments) for x in (q, k, v, g, beta))
    if segment_ids is None:
        ids, restarts = None, jnp.zeros((num_segments, batch), bool)
    else:
        ids, restarts = _to_segments(segment_ids, num_segments), segment_starts_document(
            segment_ids, segment_tokens)

    @jax.checkpoint
    def segment(state, xs):
        (q_s, k_s, v_s, g_s, beta_s), ids_s, restart = xs
        state = jnp.where(restart[:, None, None, None], 0.0, state)
        o_s, state = kda_attention(q_s, k_s, v_s, g_s, beta_s, initial_state=state,
                                   output_final_state=True, segment_ids=ids_s, **options)
        return state, o_s

    final_state, o = lax.scan(segment, state, (inputs, ids, restarts))
    return _from_segments(o), final_state if output_final_state else None
