"""KDA over a long sequence in segments, each recomputed in the backward: memory for T = 1M.

A differentiated `kda_attention` keeps, for its backward, per-chunk residuals of the whole
sequence (the state entering every 64-token chunk, float32 [B, HV, T/64, K, V], and the chunk
preparation's tiles), and the backward adds state cotangents of the same size: at T = 1,048,576
with 16 heads of 128, about 17 GiB each on top of the inputs and their gradients.

Cut into S segments of `segment_tokens` tokens, the recurrence runs segment after segment, the
state S_s [B, HV, K, V] carried between them:

    o_s, S_s = kda_attention(q_s, k_s, v_s, g_s, beta_s, initial_state=S_{s-1})

which is the same computation (the chunked algorithm already cuts the sequence at chunk
boundaries; a segment boundary is one of them). A custom VJP keeps, besides the inputs, only the
states entering the segments (S float32 [B, HV, K, V] arrays); the backward, from the last
segment to the first, recomputes one segment's forward with its residuals and runs its VJP, which
hands the state's cotangent dS_{s-1} to the segment before. Memory for residuals falls from the
whole sequence's to one segment's; the price is one more forward pass.

The segments are loops (`lax.fori_loop`), forward and backward, so a layer's program holds two
copies of the op each way (one segment before the loop, one in its body) whatever S. Each
backward iteration recomputes one segment, so the step holds one segment's residuals, never those
of several at once (as a `jax.checkpoint` per segment in an unrolled loop allows: XLA ran the
recomputations early and held them together). Not `lax.scan` under autodiff: its backward stacks
the segments' cotangents [S, B, Ts, ...] in buffers that start as zeros, and XLA, free to place
the copies of one zero broadcast anywhere, allocated those of every KDA layer at the start of the
step (a `1b` step at 128K tokens held 46 of them, 23 GiB); the buffers here start from the last
segment's cotangents (`core.chunks.filled_with`).

Packed documents: a segment whose first token starts a new document (its id differs from the
previous token's) starts from the zero state, as the unsegmented op does at a document start.
"""

import functools

import jax
import jax.numpy as jnp

from core.chunks import filled_with
from kda.api import kda_attention
from kda.chunked import CHUNK_SIZE


def is_segment_size(segment_tokens) -> bool:
    """Whether `segment_tokens` can cut sequences into segments: an int, a positive multiple of
    the 64-token chunk (so that segment boundaries are chunk boundaries)."""
    return (isinstance(segment_tokens, int) and not isinstance(segment_tokens, bool)
            and segment_tokens >= CHUNK_SIZE and segment_tokens % CHUNK_SIZE == 0)


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
    state = initial_state
    if state is None:
        state = jnp.zeros((batch, v.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    restarts = (None if segment_ids is None
                else segment_starts_document(segment_ids, segment_tokens))  # [S, B]
    o, final_state = _in_segments(segment_tokens, tuple(sorted(options.items())),
                                  (q, k, v, g, beta), state, segment_ids, restarts)
    return o, final_state if output_final_state else None


def _segment(options, state, inputs, ids, restart):
    """One segment: (o_s, S_s) from the state entering it (zero where a document starts)."""
    if restart is not None:
        state = jnp.where(restart[:, None, None, None], 0.0, state)
    return kda_attention(*inputs, initial_state=state, output_final_state=True, segment_ids=ids,
                         **dict(options))


def _part(segment_tokens, index, inputs, segment_ids, restarts):
    """Segment `index` (an int or a traced scalar): (its inputs, its segment ids or None, its
    restart flags [B] or None)."""
    def tokens(x):
        return jax.lax.dynamic_slice_in_dim(x, index * segment_tokens, segment_tokens, axis=1)

    return (tuple(map(tokens, inputs)), None if segment_ids is None else tokens(segment_ids),
            None if restarts is None else restarts[index])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _in_segments(segment_tokens, options, inputs, state, segment_ids, restarts):
    return _in_segments_forward(segment_tokens, options, inputs, state, segment_ids, restarts)[0]


def _in_segments_forward(segment_tokens, options, inputs, state, segment_ids, restarts):
    count = inputs[0].shape[1] // segment_tokens

    def run_segment(index, carry):
        o, entering, state = carry
        entering = entering.at[index].set(state)
        o_s, state = _segment(options, state, *_part(segment_tokens, index, inputs, segment_ids,
                                                     restarts))
        o = jax.lax.dynamic_update_slice_in_dim(o, o_s, index * segment_tokens, axis=1)
        return o, entering, state

    o_first, state_after = _segment(options, state, *_part(segment_tokens, 0, inputs,
                                                           segment_ids, restarts))
    carry = (filled_with(o_first, count, 1), filled_with(state[None], count, 0), state_after)
    o, entering, state = jax.lax.fori_loop(1, count, run_segment, carry)
    return (o, state), (inputs, segment_ids, restarts, entering)


def _in_segments_backward(segment_tokens, options, residuals, cotangents):
    inputs, segment_ids, restarts, entering = residuals
    d_o, d_state = cotangents
    count = entering.shape[0]

    def segment_vjp(index, d_state):
        """(the cotangent of the state entering segment `index`, those of its inputs)."""
        part_inputs, ids, restart = _part(segment_tokens, index, inputs, segment_ids, restarts)
        _, vjp = jax.vjp(lambda state, xs: _segment(options, state, xs, ids, restart),
                         entering[index], part_inputs)
        d_o_part = jax.lax.dynamic_slice_in_dim(d_o, index * segment_tokens, segment_tokens, 1)
        return vjp((d_o_part, d_state))

    def back_one_segment(step, carry):
        index = count - 2 - step  # from the last segment but one down to the first
        d_state, d_inputs = carry
        d_state, d_part = segment_vjp(index, d_state)
        d_inputs = tuple(jax.lax.dynamic_update_slice_in_dim(d, part, index * segment_tokens, 1)
                         for d, part in zip(d_inputs, d_part))
        return d_state, d_inputs

    d_state, d_last = segment_vjp(count - 1, d_state)
    carry = (d_state, tuple(filled_with(d, count, 1) for d in d_last))
    d_state, d_inputs = jax.lax.fori_loop(0, count - 1, back_one_segment, carry)
    return d_inputs, d_state, None, None


_in_segments.defvjp(_in_segments_forward, _in_segments_backward)
