"""Attention Residuals: each sub-layer reads a learned softmax mixture of earlier block outputs.

The residual stream is a set of *sealed* snapshots plus the *live* partial sum of the current
block. The first snapshot is the token embedding; every `seal_period` sub-layers the live sum is
sealed and a new one starts. Before each sub-layer (attention or FFN) and once before the final
norm, the input is a READ over the candidates [sealed..., live]:

    score_c = < RMSNorm(v_c), gain * w >       (float32, no learned bias)
    x       = sum_c softmax_c(score_c) v_c     (raw candidates, cast back)

with `w` zero-initialised, so a fresh model averages its candidates uniformly. The modes:

- Block AttnRes (K3): seal every `2 * block_size` sub-layers (block_size in transformer layers).
- Full AttnRes: seal after every sub-layer, so each sub-layer output is its own candidate.
- Plain residuals: never seal and never read; the input is the running sum.

The sealed snapshots live in a fixed buffer of `num_slots` planes and a count, so the same code
runs in a Python loop over layers and inside `lax.scan` over repeated layer groups; unfilled
slots are masked out of the softmax.
"""

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from models.sharding import logical_param

ResidualMode = Literal["block_attn_res", "full_attn_res", "plain"]


def seal_period(mode: ResidualMode, block_size: int) -> int | None:
    """Sub-layers between seals (None: never seal). block_size counts transformer layers."""
    if mode == "block_attn_res":
        return 2 * block_size
    if mode == "full_attn_res":
        return 1
    if mode == "plain":
        return None
    raise ValueError(
        f"residual mode must be 'block_attn_res', 'full_attn_res' or 'plain', got {mode!r}"
    )


def num_seal_slots(num_sublayers: int, period: int | None) -> int:
    """Snapshots sealed over a model of `num_sublayers` sub-layers (the embedding included)."""
    if period is None:
        return 0
    return -(-num_sublayers // period)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResidualStream:
    """The residual state between sub-layers.

    sealed:     [S, B, T, D]  snapshots; slot i holds data iff i < num_sealed (else zeros)
    num_sealed: [] int32
    live:       [B, T, D]     partial sum of the current block
    """

    sealed: jax.Array
    num_sealed: jax.Array
    live: jax.Array

    @classmethod
    def start(cls, embedding: jax.Array, num_slots: int) -> "ResidualStream":
        """A stream whose live sum is the embedding [B, T, D] and nothing is sealed yet."""
        sealed = jnp.zeros((num_slots,) + embedding.shape, embedding.dtype)
        return cls(sealed, jnp.zeros((), jnp.int32), embedding)

    def add(self, update: jax.Array) -> "ResidualStream":
        """Adds a sub-layer output [B, T, D] to the live sum."""
        return dataclasses.replace(self, live=self.live + update.astype(self.live.dtype))

    def seal(self, when: bool | jax.Array = True) -> "ResidualStream":
        """Seals the live sum into the next slot and restarts it at zero, if `when` holds.

        `when` may be a Python bool (static layer index) or a traced bool (scanned layers). Only
        the next slot is written, with the live sum or its own content: selecting between whole
        buffers made every scanned sub-layer copy all of [S, B, T, D] (and its gradient).
        """
        if isinstance(when, bool) and not when:
            return self
        when = jnp.asarray(when)
        slot = jax.lax.dynamic_index_in_dim(self.sealed, self.num_sealed, 0, keepdims=False)
        sealed = jax.lax.dynamic_update_index_in_dim(
            self.sealed, jnp.where(when, self.live, slot), self.num_sealed, 0)
        return ResidualStream(sealed, self.num_sealed + when.astype(jnp.int32),
                              jnp.where(when, jnp.zeros_like(self.live), self.live))


def attn_res_read(stream: ResidualStream, gain: jax.Array, query: jax.Array, eps: float):
    """Softmax over the candidates [sealed..., live] of <RMSNorm(v_c), gain * query>.

    gain, query: [D]. Returns the weighted sum of the raw candidates, [B, T, D] in live's dtype.

    The forward is elementwise products and sums over D and over the candidates, not einsums:
    contractions over D against one vector and over S <= a few candidates are reductions, and XLA
    fuses them into passes over the bf16 stream; as dots they made it write the normalised and
    float32 candidates [S, B, T, D] out, transposed for the batched matmul (forward, recomputed
    forward and backward of every read).

    The backward is written by hand (`_read_backward`) for the one contraction that is not over
    D: the gradient of the direction gain * query sums weighted candidates over every row. Autodiff
    left it to XLA column reductions, which on the H200 (`1b` step, 4 x 4096 tokens, d_model 2048)
    read the 268 MB of bf16 sealed candidates at ~460 GB/s, 0.55-0.58 ms each, a tenth of the
    bandwidth; `attn_res` took 24.8 ms a step, 19.5 ms of it backward. Here it is one
    matrix-vector product per candidate buffer (bf16 operands, float32 accumulation), which XLA on
    GPU keeps as a GEMM (it strength-reduces only dots under ~10M elements), and GEMMs stream
    their operands at close to full bandwidth. The backward saves only the inputs and per-row
    float32 statistics.
    """
    return _read(stream.sealed, stream.num_sealed, stream.live, gain, query, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _read(sealed, num_sealed, live, gain, query, eps):
    """`attn_res_read` on the stream's arrays, differentiated by `_read_backward`."""
    mixed, _ = _read_forward(sealed, num_sealed, live, gain, query, eps)
    return mixed


def _read_forward(sealed, num_sealed, live, gain, query, eps):
    """The read and what its backward needs.

    sealed: [S, B, T, D], num_sealed: [] int, live: [B, T, D], gain, query: [D].
    Returns mixed [B, T, D] in live's dtype and the residuals: the inputs other than num_sealed,
    and over the C = S + 1 candidates [sealed..., live], float32 [C, B, T] softmax weights,
    <v, direction> and rsqrt(mean(v^2) + eps). Unfilled slots get weight 0.
    """
    direction = _direction(gain, query)
    sealed_dots, sealed_rsqrt = _row_statistics(sealed, direction, eps)  # [S, B, T]
    live_dots, live_rsqrt = _row_statistics(live, direction, eps)  # [B, T]
    filled = jnp.arange(sealed.shape[0]) < num_sealed
    # -inf through `where`: a product with -inf would turn the zeros of unfilled slots into NaN.
    sealed_scores = jnp.where(filled[:, None, None], sealed_dots * sealed_rsqrt, -jnp.inf)
    scores = jnp.concatenate([sealed_scores, (live_dots * live_rsqrt)[None]], axis=0)
    probs = jax.nn.softmax(scores, axis=0)
    mixed = (jnp.sum(probs[:-1, ..., None] * sealed.astype(jnp.float32), axis=0)
             + probs[-1][..., None] * live.astype(jnp.float32))
    dots = jnp.concatenate([sealed_dots, live_dots[None]], axis=0)
    rsqrt = jnp.concatenate([sealed_rsqrt, live_rsqrt[None]], axis=0)
    return mixed.astype(live.dtype), (sealed, live, gain, query, probs, dots, rsqrt)


def _read_backward(eps, residuals, d_mixed):
    """Cotangents of (sealed, num_sealed, live, gain, query) from d_mixed [B, T, D].

    With p the softmax weights, score_c = <v_c, direction> r_c and r_c = rsqrt(mean(v_c^2) + eps):
        d_p_c       = <d_mixed, v_c>
        d_score     = p (d_p - sum_c p_c d_p_c)     (0 for unfilled slots, where p = 0)
        d_v_c       = p_c d_mixed + d_score_c r_c (direction - r_c^2 <v_c, direction> v_c / D)
        d_direction = sum over c and rows of d_score_c r_c v_c
    d_v needs only reductions over D; d_direction is one matrix-vector product per buffer.
    """
    del eps  # inside the saved rsqrt factors
    sealed, live, gain, query, probs, dots, rsqrt = residuals
    direction = _direction(gain, query)
    d_mixed = d_mixed.astype(jnp.float32)
    d_probs = jnp.concatenate([
        jnp.sum(d_mixed * sealed.astype(jnp.float32), axis=-1),
        jnp.sum(d_mixed * live.astype(jnp.float32), axis=-1)[None],
    ], axis=0)  # [C, B, T]
    d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=0))
    score_weights = d_scores * rsqrt  # d score_c / d direction = r_c v_c

    def d_candidate(v, p, weight, r_squared_dot):
        """d v [..., D] from the per-row p, d_score r and r^2 <v, direction>, all [...]."""
        v32 = v.astype(jnp.float32)
        d_v = p[..., None] * d_mixed + weight[..., None] * (
            direction - (r_squared_dot / v.shape[-1])[..., None] * v32)
        return d_v.astype(v.dtype)

    r_squared_dots = rsqrt * rsqrt * dots
    d_sealed = d_candidate(sealed, probs[:-1], score_weights[:-1], r_squared_dots[:-1])
    d_live = d_candidate(live, probs[-1], score_weights[-1], r_squared_dots[-1])
    d_direction = (_weighted_row_sum(score_weights[:-1], sealed)
                   + _weighted_row_sum(score_weights[-1], live))
    d_gain = (d_direction * query.astype(jnp.float32)).astype(gain.dtype)
    d_query = (d_direction * gain.astype(jnp.float32)).astype(query.dtype)
    return d_sealed, None, d_live, d_gain, d_query


_read.defvjp(_read_forward, _read_backward)


def _direction(gain: jax.Array, query: jax.Array) -> jax.Array:
    """The scoring direction gain * query [D], float32."""
    return gain.astype(jnp.float32) * query.astype(jnp.float32)


def _row_statistics(v: jax.Array, direction: jax.Array, eps: float):
    """<v, direction> and rsqrt(mean(v^2) + eps) over the last axis, so that
    <RMSNorm(v), direction> is their product: v [..., D], direction [D] float32 ->
    two [...] float32."""
    v = v.astype(jnp.float32)
    return (jnp.sum(v * direction, axis=-1),
            jax.lax.rsqrt(jnp.mean(jnp.square(v), axis=-1) + eps))


def _weighted_row_sum(weights: jax.Array, rows: jax.Array) -> jax.Array:
    """sum_i weights_i rows_i over all rows: weights [...], rows [..., D] -> [D] float32.

    One matrix-vector product with the weights rounded to the rows' dtype and float32
    accumulation, contracting the row axes in place (no reshape, which would fight a sharded
    batch axis).
    """
    row_axes = tuple(range(weights.ndim))
    return jax.lax.dot_general(weights.astype(rows.dtype), rows, ((row_axes, row_axes), ((), ())),
                               preferred_element_type=jnp.float32)


class AttnResRead(nnx.Module):
    """One read: a gain [D] (init 1) and a pseudo-query [D] (init 0)."""

    def __init__(self, d_model: int, *, eps: float, param_dtype: jnp.dtype = jnp.float32):
        self.eps = eps
        self.gain = logical_param(jnp.ones((d_model,), param_dtype), ("embed",))
        self.query = logical_param(jnp.zeros((d_model,), param_dtype), ("embed",))

    def __call__(self, stream: ResidualStream) -> jax.Array:
        return attn_res_read(stream, self.gain[...], self.query[...], self.eps)


def sublayer_input(
    stream: ResidualStream,
    read: AttnResRead | None,
    sublayer: int | jax.Array,
    period: int | None,
) -> tuple[jax.Array, ResidualStream]:
    """The input of sub-layer `sublayer` (0-based over the model) and the stream it then adds to.

    Reads first, then seals when the sub-layer starts a block, as K3 does: the read at a block
    start still sees the finished block as the live candidate. Plain residuals (read None) return
    the running sum.
    """
    if read is None:
        return stream.live, stream
    x = read(stream)
    starts_block = sublayer % period == 0
    if not isinstance(starts_block, bool):
        starts_block = jnp.asarray(starts_block)
    return x, stream.seal(starts_block)
