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

Layers in a Python loop keep the sealed snapshots as a tuple of planes, exactly the filled ones.
`lax.scan` over repeated layer groups needs one carry shape, so there they live in a fixed buffer
of `num_slots` planes and a count, unfilled slots masked out of the softmax
(`ResidualStream.stacked` and `unstacked` convert at a scanned group's ends).
"""

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from core.sharding import logical_param

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
    """The residual state between sub-layers, in one of two layouts.

    Planes (layers in a Python loop, whose sub-layer index is static): `sealed` is a tuple of
    exactly the filled snapshots, each [B, T, D], and `num_sealed` is None. A read touches only
    the snapshots that exist, and each has a gradient of its own: with the buffer, every read's
    backward wrote the whole [S, B, T, D] cotangent, though at the `1b` model's reads on average
    2.5 of its 4 slots are filled.

    Buffer (layers under `lax.scan`, whose carry keeps one shape): `sealed` is [S, B, T, D],
    slot i holding data iff i < `num_sealed` ([] int32), the rest zeros.

    live: [B, T, D] partial sum of the current block.
    """

    sealed: tuple[jax.Array, ...] | jax.Array
    num_sealed: jax.Array | None
    live: jax.Array

    @classmethod
    def start(cls, embedding: jax.Array) -> "ResidualStream":
        """A stream whose live sum is the embedding [B, T, D] and nothing is sealed yet."""
        return cls((), None, embedding)

    @property
    def is_buffer(self) -> bool:
        """Whether the snapshots are the fixed [S, B, T, D] buffer (else a tuple of planes)."""
        return self.num_sealed is not None

    def stacked(self, num_slots: int) -> "ResidualStream":
        """The buffer layout with `num_slots` slots (a scan's carry); a buffer stays as it is."""
        if self.is_buffer:
            return self
        if num_slots < len(self.sealed):
            raise ValueError(
                f"num_slots must hold the {len(self.sealed)} sealed snapshots, got {num_slots}"
            )
        blank = jnp.zeros((num_slots - len(self.sealed),) + self.live.shape, self.live.dtype)
        sealed = jnp.concatenate([jnp.stack(self.sealed), blank]) if self.sealed else blank
        return ResidualStream(sealed, jnp.int32(len(self.sealed)), self.live)

    def unstacked(self, num_sealed: int) -> "ResidualStream":
        """The planes layout, given the number of filled slots (static: the count of seals
        before the current sub-layer); planes stay as they are."""
        if not self.is_buffer:
            return self
        return ResidualStream(tuple(self.sealed[:num_sealed]), None, self.live)

    def add(self, update: jax.Array) -> "ResidualStream":
        """Adds a sub-layer output [B, T, D] to the live sum."""
        return dataclasses.replace(self, live=self.live + update.astype(self.live.dtype))

    def seal(self, when: bool | jax.Array = True) -> "ResidualStream":
        """Seals the live sum into the next slot and restarts it at zero, if `when` holds.

        `when` is a Python bool (static layer index) or, for the buffer layout only, a traced
        bool (scanned layers). In the buffer only the next slot is written, with the live sum or
        its own content: selecting between whole buffers made every scanned sub-layer copy all
        of [S, B, T, D] (and its gradient).
        """
        if isinstance(when, bool) and not when:
            return self
        if not self.is_buffer:
            if not isinstance(when, bool):
                raise ValueError(
                    "a traced `when` needs the buffer layout: call `stacked(num_slots)` first"
                )
            return ResidualStream(self.sealed + (self.live,), None, jnp.zeros_like(self.live))
        when = jnp.asarray(when)
        slot = jax.lax.dynamic_index_in_dim(self.sealed, self.num_sealed, 0, keepdims=False)
        sealed = jax.lax.dynamic_update_index_in_dim(
            self.sealed, jnp.where(when, self.live, slot), self.num_sealed, 0)
        return ResidualStream(sealed, self.num_sealed + when.astype(jnp.int32),
                              jnp.where(when, jnp.zeros_like(self.live), self.live))


def attn_res_read(stream: ResidualStream, gain: jax.Array, query: jax.Array, eps: float):
    """Softmax over the candidates [sealed..., live] of <RMSNorm(v_c), gain * query>.

    gain, query: [D]. Returns the weighted sum of the raw candidates, [B, T, D] in live's dtype.
    Both layouts read through `_mix`, plane by plane; the buffer's unfilled slots are masked out
    of the softmax.
    """
    direction = gain.astype(jnp.float32) * query.astype(jnp.float32)
    if not stream.is_buffer:
        score_bias = jnp.zeros(len(stream.sealed) + 1, jnp.float32)
    else:
        filled = jnp.arange(stream.sealed.shape[0]) < stream.num_sealed
        score_bias = jnp.append(jnp.where(filled, 0.0, -jnp.inf), 0.0)
    return _mix(stream.sealed, stream.live, direction, score_bias, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mix(sealed, live, direction, score_bias, eps):
    """sum_c softmax_c(<RMSNorm(v_c), direction> + score_bias_c) v_c over the candidates
    v = [sealed..., live].

    sealed: a tuple of planes [B, T, D] or a buffer [S, B, T, D] (its slots are the planes; it
    is kept whole for the backward, not copied slot by slot); live: [B, T, D], the dtype of
    them all; direction: [D] float32; score_bias: [C] float32 (0, or -inf for a buffer slot not
    yet filled). Returns [B, T, D] in live's dtype.

    Every contraction here is an elementwise product summed over D or over the C candidates,
    which XLA fuses into passes over the stream; the backward is written out (`_mix_backward`)
    so that the direction's gradient, a sum over all B*T tokens, is a matrix product reading each
    bf16 plane once: autodiff's column reductions fused with each plane's cotangent run several
    times slower than their bytes take (`benchmarks/attn_res_h200.md`).
    """
    return _mix_forward(sealed, live, direction, score_bias, eps)[0]


def _mix_forward(sealed, live, direction, score_bias, eps):
    candidates = tuple(sealed) + (live,)
    inv_rms = jnp.stack([jax.lax.rsqrt(jnp.mean(jnp.square(v.astype(jnp.float32)), axis=-1) + eps)
                         for v in candidates])  # [C, B, T]
    scores = jnp.stack([jnp.sum(v.astype(jnp.float32) * direction, axis=-1)
                        for v in candidates]) * inv_rms
    probs = jax.nn.softmax(scores + score_bias[:, None, None], axis=0)
    mixed = sum(p[..., None] * v.astype(jnp.float32) for p, v in zip(probs, candidates))
    return mixed.astype(live.dtype), (sealed, live, direction, score_bias, probs, scores, inv_rms)


def _mix_backward(eps, residuals, d_out):
    """With s_c = <v_c, d> r_c, r_c = rsqrt(mean(v_c^2) + eps) and p = softmax(s):
    ds_c = p_c (<d_out, v_c> - sum_c' p_c' <d_out, v_c'>), and through r_c's dependence on v_c
    dv_c = p_c d_out + ds_c r_c d - ds_c s_c r_c^2 / D v_c, dd = sum_tokens sum_c ds_c r_c v_c."""
    del eps
    sealed, live, direction, score_bias, probs, scores, inv_rms = residuals
    candidates = tuple(sealed) + (live,)
    d_out = d_out.astype(jnp.float32)
    d_probs = jnp.stack([jnp.sum(d_out * v.astype(jnp.float32), axis=-1) for v in candidates])
    d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=0))
    along_direction = d_scores * inv_rms  # [C, B, T]
    along_candidate = along_direction * scores * inv_rms / d_out.shape[-1]
    d_candidates = tuple(
        (p[..., None] * d_out + a[..., None] * direction - b[..., None] * v.astype(jnp.float32)
         ).astype(v.dtype)
        for v, p, a, b in zip(candidates, probs, along_direction, along_candidate))
    d_direction = sum(_token_weighted_sum(a, v) for a, v in zip(along_direction, candidates))
    d_sealed = d_candidates[:-1]
    if not isinstance(sealed, tuple):  # the buffer's cotangent, an empty one included
        d_sealed = jnp.stack(d_sealed) if d_sealed else jnp.zeros_like(sealed)
    return d_sealed, d_candidates[-1], d_direction, jnp.zeros_like(score_bias)


_mix.defvjp(_mix_forward, _mix_backward)


def _token_weighted_sum(weights: jax.Array, plane: jax.Array) -> jax.Array:
    """sum over tokens of weights * plane: weights [B, T] float32, plane [B, T, D] -> [D] float32.

    One matrix product reading the plane in its own dtype, accumulating in float32. The weights
    enter as rows in that dtype, each the rounding of what the rows before left (three for bf16:
    8 bits of mantissa each), so their sum is the float32 weights and the result is as accurate
    as float32 weights times the plane, at the cost of reading the plane once.
    """
    num_rows = -(-_significand_bits(jnp.float32) // _significand_bits(plane.dtype))
    rows, rest = [], weights
    for _ in range(num_rows):
        rows.append(rest.astype(plane.dtype))
        rest = rest - rows[-1].astype(jnp.float32)
    token_axes = tuple(range(weights.ndim))
    sums = jax.lax.dot_general(jnp.stack(rows), plane,
                               ((tuple(a + 1 for a in token_axes), token_axes), ((), ())),
                               preferred_element_type=jnp.float32)  # [rows, D]
    return jnp.sum(sums, axis=0)


def _significand_bits(dtype) -> int:
    return jnp.finfo(dtype).nmant + 1


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
