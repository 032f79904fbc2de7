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

    Written as elementwise products and sums over D and over the candidates, not as einsums:
    contractions over D against one vector and over S <= a few candidates are reductions, and XLA
    fuses them into passes over the bf16 stream; as dots they made it write the normalised and
    float32 candidates [S, B, T, D] out, transposed for the batched matmul (forward, recomputed
    forward and backward of every read).
    """
    direction = gain.astype(jnp.float32) * query.astype(jnp.float32)
    live_score = _normalized_score(stream.live, direction, eps)  # [B, T]
    if not stream.is_buffer:
        candidates = stream.sealed + (stream.live,)
        scores = [_normalized_score(v, direction, eps) for v in stream.sealed] + [live_score]
        probs = jax.nn.softmax(jnp.stack(scores), axis=0)  # [C, B, T]
        mixed = sum(p[..., None] * v.astype(jnp.float32) for p, v in zip(probs, candidates))
        return mixed.astype(stream.live.dtype)
    sealed_scores = _normalized_score(stream.sealed, direction, eps)  # [S, B, T]
    filled = jnp.arange(stream.sealed.shape[0]) < stream.num_sealed
    sealed_scores = jnp.where(filled[:, None, None], sealed_scores, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([sealed_scores, live_score[None]], axis=0), axis=0)
    mixed = (jnp.sum(probs[:-1, ..., None] * stream.sealed.astype(jnp.float32), axis=0)
             + probs[-1][..., None] * stream.live.astype(jnp.float32))
    return mixed.astype(stream.live.dtype)


def _normalized_score(v: jax.Array, direction: jax.Array, eps: float) -> jax.Array:
    """<RMSNorm(v), direction> = <v, direction> / rms(v) over the last axis: v [..., D],
    direction [D] float32 -> [...] float32."""
    v = v.astype(jnp.float32)
    return jnp.sum(v * direction, axis=-1) * jax.lax.rsqrt(
        jnp.mean(jnp.square(v), axis=-1) + eps)


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
