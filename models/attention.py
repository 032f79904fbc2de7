"""Gated Multi-head Latent Attention without positional encoding (the K3 full-attention layer).

Projections (d = d_model, H heads, N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim,
C = kv_lora_rank, Q = q_lora_rank):

    c_q          = RMSNorm(x W_qa)                       x W_qa: d -> Q (or c_q = x, no Q)
    [q_n ; q_r]  = c_q W_qb                              per head N + R
    [c_kv ; k_r] = x W_kva                               d -> C + R, then c_kv <- RMSNorm(c_kv)
    [k_n ; v]    = c_kv W_kvb                            per head N + V
    k            = [k_n ; k_r]                           k_r: one R-dim key part shared by all heads
    o            = softmax(q k^T / sqrt(N + R)) v        causal, within a document
    y            = W_o (sigmoid(x W_g) * o)              elementwise, per head, after attention
                                                         (y = W_o o without the gate)

The R-dim "rope" part keeps its released name but is never rotated: the model has no positional
encoding (order comes from the KDA layers), so it is an extra key channel shared across heads.

Training runs on Hopper GPUs through cuDNN's packed layout (`implementation="cudnn_segments"`),
which describes each row's documents by their offsets and lengths (`document_segments`), so that
cuDNN skips the tiles between documents (a batch with a row of more documents than it was sized
for runs `models.blockwise_attention`, exact and memory-linear); elsewhere through `jax.nn.dot_product_attention` (cuDNN on
other GPUs, XLA otherwise), packed documents kept apart by a dense [B, 1, T, T] mask. The vision
tower's bidirectional attention within each image takes the same paths (`document_attention` with
causal=False).

With the tokens split over a `seq` mesh axis (context parallelism, `core.context_parallel`), the
training path gathers the latents [c_kv ; k_r] of every shard (C + R numbers a token, not the
H (N + V) of keys and values), up-projects them on each device and runs causal attention of its
local queries, at their global positions, against every key (`context_parallel_attention`).

Decoding runs in the latent space: W_kvb's key half is absorbed into the query and its value half
applied after the weighted sum, so the cache holds only [c_kv ; k_r] (C + R = 576 numbers per
token at full size) in a paged pool (`models.paged_cache`). Cached attention walks each row's
block table a block of pages at a time with an online softmax (`paged_latent_attention`): it reads
only the blocks the batch's rows hold, and its memory does not grow with the cache's capacity.
"""

import dataclasses
import functools
from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fused

from core.context_parallel import all_tokens, context_shards, over_token_shards, shard_index
from kda.common import document_index, document_starts
from models.blockwise_attention import blockwise_document_attention
from core.norms import RMSNorm
from models.paged_cache import PagedLatentCache
from core.sharding import logical

# "xla" and "cudnn" keep documents apart with a dense mask; "cudnn_segments" describes them to
# cuDNN's packed layout (Hopper only; see `causal_document_attention`).
AttentionImplementation = Literal["xla", "cudnn", "cudnn_segments"]
# What the packed cuDNN path needs (jax 0.11.2's cuDNN wrapper and its own tests): Hopper or newer,
# cuDNN 9.6 or newer, 16-bit inputs, one head size for q, k and v of at most 256, a multiple of 8.
PACKED_MIN_COMPUTE_CAPABILITY = (9, 0)
PACKED_MIN_CUDNN_VERSION = 90600
PACKED_MAX_HEAD_DIM = 256
# Block-table pages that `paged_latent_attention` reads per step: its scores are
# [B, H, T, PAGED_BLOCK_PAGES * page_size] float32 whatever the cache's capacity.
PAGED_BLOCK_PAGES = 16


def is_positive_int(value) -> bool:
    """An int of at least 1 (a bool is refused: `True` is no size)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Gated MLA hyper-parameters; field names follow the released K3 config."""

    num_heads: int
    q_lora_rank: int | None  # None: queries straight from x (Kimi Linear), no low-rank step
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = True
    norm_eps: float = 1e-5
    # None picks "cudnn_segments" where it can run (Hopper, cuDNN 9.6+, 16-bit compute), else
    # "cudnn" on other GPUs for 16-bit compute and "xla" otherwise (`default_implementation`).
    implementation: AttentionImplementation | None = None
    # With "cudnn_segments": the most documents (runs of segment ids, a row's trailing padding run
    # included) a packed row may hold, static. A batch with a fuller row takes the dense-mask path.
    max_segments: int = 16
    # Cached attention (prefill chunks, decode steps) reads the block table this many pages at a
    # time (`paged_latent_attention`): its scores are [B, H, T, cache_pages_per_block * page_size].
    cache_pages_per_block: int = PAGED_BLOCK_PAGES
    # How the training path shares keys across a `seq` mesh axis (`CONTEXT_PARALLEL_ATTENTION`).
    context_parallel: str = "all_gather"

    def __post_init__(self):
        names = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "max_segments", "cache_pages_per_block")
        if self.q_lora_rank is not None:
            names += ("q_lora_rank",)
        for name in names:
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {value!r}")
        if self.context_parallel not in CONTEXT_PARALLEL_ATTENTION:
            raise ValueError(
                f"MLAConfig.context_parallel must be one of {sorted(CONTEXT_PARALLEL_ATTENTION)}, "
                f"got {self.context_parallel!r}"
            )
        if self.implementation not in (None, *get_args(AttentionImplementation)):
            raise ValueError(
                f"MLAConfig.implementation must be None or one of "
                f"{get_args(AttentionImplementation)}, got {self.implementation!r}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token: the normed c_kv plus the shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5


def count_mla_params(d_model: int, cfg: MLAConfig) -> int:
    """Parameters of one Gated MLA layer (all of them active for every token)."""
    heads = cfg.num_heads
    if cfg.q_lora_rank is None:
        queries = d_model * heads * cfg.qk_head_dim
    else:  # down projection, norm gain, up projection
        queries = (d_model + 1 + heads * cfg.qk_head_dim) * cfg.q_lora_rank
    return (
        queries
        + d_model * cfg.latent_dim
        + cfg.kv_lora_rank  # kv norm gain
        + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + (d_model * heads * cfg.v_head_dim if cfg.output_gate else 0)
        + heads * cfg.v_head_dim * d_model  # output projection
    )


class DocumentSegments(NamedTuple):
    """Each row's documents as cuDNN's packed layout takes them (M = max_segments).

    offsets: int32 [B, M + 1], where each document starts, in order, then -1: the entry after a
        row's last document is always -1, never the row's end (jax's wrapper counts every
        non-negative entry as one more document), so the last column is -1 in every row.
    lengths: int32 [B, M], each document's length, then -1.
    fits: bool [B], whether the row holds at most M documents; a row that holds more keeps only
        its first M in `offsets` and `lengths`.
    """

    offsets: jax.Array
    lengths: jax.Array
    fits: jax.Array


def document_segments(segment_ids: jax.Array, max_segments: int) -> DocumentSegments:
    """The packed description of the documents of `segment_ids` [B, T] int, with room for
    `max_segments` (M) of them a row.

    Documents are runs of equal ids (`kda.common.document_starts`, as the KDA layers reset their
    state), so a trailing run of padding ids is a document too.
    """
    if not is_positive_int(max_segments):
        raise ValueError(
            f"max_segments must be a positive int (the most documents a packed row may hold), "
            f"got {max_segments!r}"
        )
    if segment_ids.ndim != 2 or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"segment_ids must be an integer array [B, T], got {segment_ids.dtype} "
            f"{segment_ids.shape}"
        )
    batch, length = segment_ids.shape
    document = document_index(segment_ids)
    starts = document_starts(segment_ids).at[:, 0].set(True)  # [B, T]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    # Slot M (out of bounds) receives the tokens that start no document and documents past M.
    start_slot = jnp.where(starts, document, max_segments)
    offsets = jnp.full((batch, max_segments), -1, jnp.int32)
    offsets = offsets.at[rows, start_slot].set(positions, mode="drop")
    lengths = jnp.zeros((batch, max_segments), jnp.int32).at[rows, document].add(1, mode="drop")
    lengths = jnp.where(offsets >= 0, lengths, -1)
    offsets = jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)
    return DocumentSegments(offsets, lengths, document[:, -1] < max_segments)


def backend_implementation(dtype: jnp.dtype) -> AttentionImplementation:
    """The dense-mask implementation for `dtype` inputs on this backend: cuDNN's flash attention on
    a GPU for 16-bit inputs (it takes no others), XLA otherwise."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if jax.default_backend() == "gpu" and sixteen_bit else "xla"


def pad_head_dims(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
    """q, k, v zero-padded to one head size, as cuDNN wants it: padding changes neither the scores
    (padded q and k) nor the output (padded v, to be sliced off)."""
    width = max(q.shape[-1], v.shape[-1])
    return tuple(jnp.pad(t, [(0, 0)] * 3 + [(0, width - t.shape[-1])]) for t in (q, k, v))


def _dense_document_attention(q, k, v, *, scale, document_ids, implementation, causal):
    """Attention (causal or not) within equal `document_ids` [B, T] (or none), as a dense
    [B, 1, T, T] mask; q, k, v of one head size."""
    mask = None
    if document_ids is not None:
        mask = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal,
                                        implementation=implementation)


def packed_cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: DocumentSegments, *, scale: float,
    causal: bool = True,
) -> jax.Array:
    """Attention within the documents `segments` describes, by cuDNN's packed layout: causal, or
    bidirectional within each document with causal=False (cuDNN's padding mask without the
    causal part).

    q, k, v: [B, T, H, D] (one head size, BTNH: jax's wrapper converts the offsets to element
    strides assuming BTNH, and scales both key and value offsets by the key's head size, so v must
    not be narrower) -> [B, T, H, D]. Every row must fit (`segments.fits`); tokens outside the
    described documents are not computed. Call `causal_document_attention` for a safe entry.
    """
    return cudnn_fused.dot_product_attention(
        q, k, v,
        q_seqlen=segments.lengths, kv_seqlen=segments.lengths,
        q_offsets=segments.offsets, kv_offsets=segments.offsets,
        scale=scale, qkv_layout="BTNH",
        mask_type=cudnn_fused.MaskType.PADDING_CAUSAL if causal else cudnn_fused.MaskType.PADDING,
    )


def _cuda_compute_capability() -> tuple[int, ...] | None:
    device = jax.devices()[0]
    try:
        return tuple(int(part) for part in device.compute_capability.split("."))
    except (AttributeError, ValueError):  # a CPU, a TPU or a ROCm GPU
        return None


def _packed_cudnn_refusal(dtype: jnp.dtype, head_dim: int) -> str | None:
    """Why cuDNN's packed layout cannot run inputs of `dtype` and one head size `head_dim` (v padded
    to q's or q and k to v's) on this machine, with the way out; None when it can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs bfloat16 or float16 q, k and v, got {dtype}: cast them or use 'xla'"
    if head_dim > PACKED_MAX_HEAD_DIM or head_dim % 8:
        return (f"needs a head size (after padding v to q's or q and k to v's) of at most "
                f"{PACKED_MAX_HEAD_DIM} and a multiple of 8, got {head_dim}: use 'xla'")
    capability = _cuda_compute_capability()
    if capability is None or capability < PACKED_MIN_COMPUTE_CAPABILITY:
        return (f"needs an NVIDIA GPU of compute capability 9.0 or more (Hopper); JAX runs on "
                f"{jax.devices()[0].device_kind!r}: use 'cudnn' on older GPUs, 'xla' elsewhere")
    cudnn_version = cudnn_fused.check_cudnn_version()
    if cudnn_version < PACKED_MIN_CUDNN_VERSION:
        return f"needs cuDNN 9.6 or newer, found version {cudnn_version}: use 'cudnn'"
    return None


def _require_packed_cudnn(q: jax.Array) -> None:
    """Raises ValueError unless cuDNN's packed layout can run q (padded to one head size) here;
    cuDNN's wrapper would otherwise fail deep inside the trace, or its lowering on a CPU."""
    refusal = _packed_cudnn_refusal(q.dtype, q.shape[-1])
    if refusal is not None:
        raise ValueError(f"implementation='cudnn_segments' {refusal}")


def default_implementation(dtype: jnp.dtype, head_dim: int) -> AttentionImplementation:
    """What `MLAConfig(implementation=None)` runs for `dtype` inputs of one head size `head_dim`:
    cuDNN's packed layout where it can run (it skips the tiles between documents, several times
    faster than the dense mask: `benchmarks/attention_h200.md`), else the dense mask through cuDNN
    on a GPU or XLA elsewhere (`backend_implementation`)."""
    if _packed_cudnn_refusal(dtype, head_dim) is None:
        return "cudnn_segments"
    return backend_implementation(dtype)


def _segmented_attention(q, k, v, *, scale, segment_ids, max_segments, causal):
    """The "cudnn_segments" path of `document_attention` (q, k, v of one head size)."""
    if not is_positive_int(max_segments):
        raise ValueError(f"implementation='cudnn_segments' needs max_segments, a positive int "
                         f"(MLAConfig.max_segments, VisionConfig.max_segments), got "
                         f"{max_segments!r}")
    _require_packed_cudnn(q)
    if segment_ids is None:  # cuDNN's causal (or unmasked) flash attention, no mask to hold
        return _dense_document_attention(q, k, v, scale=scale, document_ids=None,
                                         implementation=backend_implementation(q.dtype),
                                         causal=causal)
    if segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids must be [B, T] = {q.shape[:2]} like q, got "
                         f"{segment_ids.shape}")
    segments = document_segments(segment_ids, max_segments)
    # The dense path keeps documents as runs too, so that both branches compute the same thing
    # whatever the ids (the dense mask alone would join two runs of one id).
    document_ids = document_index(segment_ids)

    def blockwise(q, k, v):
        return blockwise_document_attention(q, k, v, scale=scale, document_ids=document_ids,
                                            causal=causal)

    # M sizes the cuDNN call (its softmax statistics are [B * M, H, T]), so it is static, and a
    # row with more documents cannot be described. Rather than ever computing such a row wrong,
    # the whole call falls back to plain-JAX tiles: both programs are compiled, one runs. (M = T
    # would always fit but launches B * T mostly empty segments; the dense mask would cost
    # B T^2 bytes, 16 GiB a layer at 128K tokens, in every step's memory plan.)
    return jax.lax.cond(
        jnp.all(segments.fits),
        lambda q, k, v: packed_cudnn_attention(q, k, v, segments, scale=scale, causal=causal),
        blockwise, q, k, v,
    )


def document_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    causal: bool,
    segment_ids: jax.Array | None = None,
    implementation: AttentionImplementation | None = None,
    max_segments: int | None = None,
) -> jax.Array:
    """Softmax attention, causal or bidirectional, restricted to one document when `segment_ids`
    is given.

    q, k: [B, T, H, Dqk]; v: [B, T, H, Dv]; segment_ids: [B, T] int -> [B, T, H, Dv].

    causal: each token sees the keys up to its own (the decoder), or every key of its document
        (the vision tower's images).
    implementation: "xla" (or None) and "cudnn" mask every pair of tokens whose ids differ with a
        dense [B, 1, T, T] mask; "cudnn_segments" (Hopper GPUs, 16-bit inputs) runs cuDNN's packed
        layout over each row's documents, runs of equal ids (`document_segments`), when every row
        holds at most `max_segments` of them, and plain-JAX tiles in memory linear in T otherwise
        (`models.blockwise_attention`). For rows whose ids increase along the row, as the packer
        writes them, all agree.
    max_segments: M of "cudnn_segments" (`MLAConfig.max_segments`, `VisionConfig.max_segments`);
        the dense paths ignore it.
    """
    q_padded, k_padded, v_padded = pad_head_dims(q, k, v)
    if implementation == "cudnn_segments":
        out = _segmented_attention(q_padded, k_padded, v_padded, scale=scale,
                                   segment_ids=segment_ids, max_segments=max_segments,
                                   causal=causal)
    else:
        out = _dense_document_attention(q_padded, k_padded, v_padded, scale=scale,
                                        document_ids=segment_ids, implementation=implementation,
                                        causal=causal)
    return out[..., : v.shape[-1]]


def causal_document_attention(q: jax.Array, k: jax.Array, v: jax.Array, **options) -> jax.Array:
    """Gated MLA's training attention: `document_attention` with causal=True, its keyword
    arguments (scale, segment_ids, implementation, max_segments) passed on."""
    return document_attention(q, k, v, causal=True, **options)


def gathered_latent_attention(
    q: jax.Array,
    latents: jax.Array,
    kv_up: jax.Array,
    segment_ids: jax.Array,
    *,
    cfg: MLAConfig,
    implementation: AttentionImplementation,
) -> jax.Array:
    """One shard's causal document attention under context parallelism, inside `shard_map` with
    the `seq` axis manual: every shard's latents gathered (one all-gather of [B, Tl, C + R]),
    up-projected here, and attended by the local queries.

    q: [B, Tl, H, N + R], this shard's queries; latents: [B, Tl, C + R], its [normed c_kv ; k_r];
    kv_up: [C, H, N + V] (W_kvb); segment_ids: [B, Tl] int -> [B, Tl, H, V].

    Query i of shard p sits at position p Tl + i and sees the keys at positions up to its own with
    its segment id (the dense path's document rule, `causal_document_attention`); the mask is
    [B, 1, Tl, T] and the keys and values [B, T, H, N + R | V], on every shard.
    """
    local = q.shape[1]
    every_latent, every_id = all_tokens(latents), all_tokens(segment_ids)  # [B, T, ...]
    c_kv, k_rope = jnp.split(every_latent, [cfg.kv_lora_rank], axis=-1)
    k_nope, v = jnp.split(jnp.einsum("bsc,chk->bshk", c_kv, kv_up.astype(c_kv.dtype)),
                          [cfg.qk_nope_head_dim], axis=-1)
    k = jnp.concatenate(
        [k_nope, jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:-1], k_rope.shape[-1]))],
        axis=-1)
    query_positions = shard_index() * local + jnp.arange(local)
    causal = jnp.arange(every_id.shape[1])[None, :] <= query_positions[:, None]  # [Tl, T]
    mask = causal[None] & (segment_ids[:, :, None] == every_id[:, None, :])  # [B, Tl, T]
    q, k, v_padded = pad_head_dims(q, k, v)
    out = jax.nn.dot_product_attention(q, k, v_padded, mask=mask[:, None], scale=cfg.softmax_scale,
                                       implementation=implementation)
    return out[..., : v.shape[-1]]


# How the training path shares keys across a `seq` mesh axis (`MLAConfig.context_parallel`): each
# is one shard's part, (q, latents, kv_up, segment_ids, *, cfg, implementation) -> o, with the
# signature of `gathered_latent_attention`. A ring (the latents passed shard to shard with
# `jax.lax.ppermute`, an online softmax over the blocks) would hold one block of keys at a time
# instead of all T; which is faster is for GPU measurements to say.
CONTEXT_PARALLEL_ATTENTION = {"all_gather": gathered_latent_attention}


def context_parallel_attention(
    q: jax.Array,
    latents: jax.Array,
    kv_up: jax.Array,
    segment_ids: jax.Array | None,
    *,
    cfg: MLAConfig,
    implementation: AttentionImplementation,
) -> jax.Array:
    """Gated MLA's training-path attention with the tokens split over the current mesh's `seq`
    axis (called under `jax.set_mesh`, outside `shard_map`): `cfg.context_parallel`'s scheme of
    `CONTEXT_PARALLEL_ATTENTION` on each shard.

    q: [B, T, H, N + R]; latents: [B, T, C + R]; kv_up: [C, H, N + V]; segment_ids: [B, T] int or
    None (one document a row) -> [B, T, H, V]. T must divide by the `seq` axis size.
    implementation: "xla" or "cudnn" (the dense mask; cuDNN's packed layout takes no offset
    queries).
    """
    batch, length, heads, _ = q.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    tokens = ("batch", "seq", "heads", None)
    sharded = over_token_shards(
        functools.partial(CONTEXT_PARALLEL_ATTENTION[cfg.context_parallel], cfg=cfg,
                          implementation=implementation),
        in_names=(tokens, ("batch", "seq", None), (None, "heads", None), ("batch", "seq")),
        out_names=tokens, batch=batch, length=length, heads=heads)
    return sharded(q, latents, kv_up, segment_ids)


def absorb_queries(q_nope: jax.Array, key_up: jax.Array) -> jax.Array:
    """q_c = q_n W_k^T, the no-rope query part in the latent space: q_nope [B, T, H, N] and
    key_up [C, H, N] (W_kvb's key half) -> [B, T, H, C] in q_nope's dtype."""
    return jnp.einsum("bthn,chn->bthc", q_nope, key_up.astype(q_nope.dtype))


def latent_scores(
    q_latent: jax.Array, q_rope: jax.Array, latents: jax.Array, *, scale: float
) -> jax.Array:
    """z = scale * (q_c . c_kv + q_r . k_r) of queries q_latent [B, T, H, C], q_rope [B, T, H, R]
    and keys latents [B, S, C + R] -> [B, H, T, S] float32 (unmasked)."""
    c_kv, k_rope = jnp.split(latents, [q_latent.shape[-1]], axis=-1)
    scores = jnp.einsum(
        "bthc,bsc->bhts", q_latent, c_kv.astype(q_latent.dtype), preferred_element_type=jnp.float32
    ) + jnp.einsum(
        "bthr,bsr->bhts", q_rope, k_rope.astype(q_rope.dtype), preferred_element_type=jnp.float32
    )
    return scores * scale


def expand_values(out_latent: jax.Array, value_up: jax.Array) -> jax.Array:
    """o = o_c W_v: the attention output in the latent space [B, T, H, C] and value_up [C, H, V]
    (W_kvb's value half) -> [B, T, H, V] in out_latent's dtype."""
    return jnp.einsum("bthc,chv->bthv", out_latent, value_up.astype(out_latent.dtype))


def absorbed_latent_attention(
    q_nope: jax.Array,
    q_rope: jax.Array,
    latents: jax.Array,
    kv_up: jax.Array,
    query_positions: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """MLA attention computed in the latent space over every given key at once: the dense
    reference of `paged_latent_attention` (its tests' oracle).

    q_nope: [B, T, H, N], q_rope: [B, T, H, R]; latents: [B, S, C + R] ([c_kv ; k_r] of every
    cached position); kv_up: [C, H, N + V] (W_kvb); query_positions: [B, T] int32, the position of
    each query, which sees keys at positions <= its own. -> [B, T, H, V].
    Its scores are [B, H, T, S] float32.
    """
    key_up, value_up = jnp.split(kv_up, [q_nope.shape[-1]], axis=-1)  # [C, H, N], [C, H, V]
    q_latent = absorb_queries(q_nope, key_up)
    scores = latent_scores(q_latent, q_rope, latents, scale=scale)
    key_positions = jnp.arange(latents.shape[1], dtype=jnp.int32)
    visible = key_positions[None, None, None, :] <= query_positions[:, None, :, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    c_kv = latents[..., : q_latent.shape[-1]]
    out_latent = jnp.einsum("bhts,bsc->bthc", probs.astype(q_nope.dtype), c_kv.astype(q_nope.dtype))
    return expand_values(out_latent, value_up)


class OnlineSoftmax(NamedTuple):
    """The running state of a softmax over blocks of keys, for queries [B, T, H].

    max_score: [B, H, T] float32, m: the largest visible score so far (-inf before any);
    total: [B, H, T] float32, l: sum of exp(score - m) over the visible keys so far;
    acc: [B, T, H, C] float32, a: sum of exp(score - m) c_kv over them (the latent-space output,
        unnormalised).
    """

    max_score: jax.Array
    total: jax.Array
    acc: jax.Array


def online_softmax_start(q_latent: jax.Array) -> OnlineSoftmax:
    """The state before any key, for queries q_latent [B, T, H, C]."""
    batch, length, heads, rank = q_latent.shape
    stats_shape = (batch, heads, length)
    return OnlineSoftmax(
        max_score=jnp.full(stats_shape, -jnp.inf, jnp.float32),
        total=jnp.zeros(stats_shape, jnp.float32),
        acc=jnp.zeros((batch, length, heads, rank), jnp.float32),
    )


def online_softmax_update(
    state: OnlineSoftmax, scores: jax.Array, c_kv: jax.Array, dtype: jnp.dtype
) -> OnlineSoftmax:
    """Adds one block of keys: masked scores [B, H, T, K] float32 (-inf where not visible) and
    their values c_kv [B, K, C]. The block's weights exp(z - m) and c_kv enter their product in
    `dtype` (the queries'), accumulated in float32.

    The old terms are rescaled to the new max by exp(m_old - m_new). A query that has seen no
    visible key yet keeps max -inf; it takes 0 as its reference so that its terms stay 0, not NaN.
    """
    new_max = jnp.maximum(state.max_score, jnp.max(scores, axis=-1))  # [B, H, T]
    reference = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
    rescale = jnp.exp(state.max_score - reference)  # [B, H, T]; 0 while nothing was seen
    weights = jnp.exp(scores - reference[..., None])  # [B, H, T, K]; 0 where not visible
    block_acc = jnp.einsum("bhtk,bkc->bthc", weights.astype(dtype), c_kv.astype(dtype),
                           preferred_element_type=jnp.float32)
    return OnlineSoftmax(
        max_score=new_max,
        total=rescale * state.total + jnp.sum(weights, axis=-1),
        acc=jnp.swapaxes(rescale, 1, 2)[..., None] * state.acc + block_acc,
    )


def online_softmax_result(state: OnlineSoftmax) -> jax.Array:
    """acc / total: the softmax-weighted sum of c_kv, [B, T, H, C] float32."""
    return state.acc / jnp.swapaxes(state.total, 1, 2)[..., None]


def visible_keys(
    key_positions: jax.Array, query_positions: jax.Array, held: jax.Array
) -> jax.Array:
    """Which keys each query sees: key_positions [K] int32 against query_positions [B, T] and the
    tokens each row's table holds, held [B] -> [B, 1, T, K] bool (key <= query and key < held)."""
    causal = key_positions[None, None, None, :] <= query_positions[:, None, :, None]
    cached = key_positions[None, None, None, :] < held[:, None, None, None]
    return causal & cached


def blocks_to_read(query_positions: jax.Array, held: jax.Array, block_tokens: int) -> jax.Array:
    """How many blocks of `block_tokens` keys hold a key that some query of the batch sees, given
    query_positions [B, T] and the tokens each row's table holds, held [B]: int32 scalar.

    Row b's queries see keys < min(held_b, max_t position_bt + 1).
    """
    seen = jnp.minimum(held, jnp.max(query_positions, axis=1) + 1)  # [B]
    return (-(-jnp.max(seen) // block_tokens)).astype(jnp.int32)  # ceil


def check_pages_per_block(pages_per_block) -> None:
    """Raises a ValueError naming `pages_per_block` unless it is an int >= 1."""
    if not is_positive_int(pages_per_block):
        raise ValueError(
            f"pages_per_block must be a positive int (block-table pages read per step of the "
            f"paged attention; try {PAGED_BLOCK_PAGES}), got {pages_per_block!r}"
        )


def paged_latent_attention(
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache: PagedLatentCache,
    kv_up: jax.Array,
    query_positions: jax.Array,
    *,
    scale: float,
    pages_per_block: int = PAGED_BLOCK_PAGES,
) -> jax.Array:
    """MLA attention in the latent space over a paged cache, a block of pages at a time
    (flash decoding): `absorbed_latent_attention` of the cache's gathered latents, up to float32
    rounding, without ever gathering them.

    q_nope: [B, T, H, N], q_rope: [B, T, H, R]; cache: the layer's `PagedLatentCache`, the queries'
    own latents already appended; kv_up: [C, H, N + V] (W_kvb); query_positions: [B, T] int32 ->
    [B, T, H, V]. A query sees the keys at positions <= its own, < its row's length and within
    its table's capacity.

    With q_c = q_n W_k^T and the key of position s cached as [c_s ; r_s], over the blocks
    j = 0, 1, .. of K = pages_per_block * page_size keys:

        z_s    = scale * (q_c . c_s + q_r . r_s)                -inf where s is not visible
        m_j    = max(m_{j-1}, max_{s in j} z_s)                  m_{-1} = -inf
        l_j    = exp(m_{j-1} - m_j) l_{j-1}   + sum_{s in j} exp(z_s - m_j)
        a_j    = exp(m_{j-1} - m_j) a_{j-1}   + sum_{s in j} exp(z_s - m_j) c_s
        o      = (a_last / l_last) W_v

    Block j gathers only its own pages of each row's block table ([B, K, C + R]); the loop runs
    only over the blocks that some row's queries see (`blocks_to_read`), so a step reads the pages
    the batch holds, not the table's capacity, and its scores are [B, H, T, K] float32.

    pages_per_block: block-table pages per block, an int >= 1; a larger value than the table's
    width reads the whole table in one block.
    """
    check_pages_per_block(pages_per_block)
    pages_per_block = min(pages_per_block, cache.block_tables.shape[1])  # at most the table
    block_tokens = pages_per_block * cache.page_size
    # A row that ended keeps decoding past its table's end; it sees only what the table holds.
    held = jnp.minimum(cache.lengths, cache.capacity)  # [B]
    key_up, value_up = jnp.split(kv_up, [q_nope.shape[-1]], axis=-1)  # [C, H, N], [C, H, V]
    q_latent = absorb_queries(q_nope, key_up)  # [B, T, H, C]
    rank = q_latent.shape[-1]

    def add_block(block, state):
        first_page = block * pages_per_block
        latents = cache.read_pages(first_page, pages_per_block)  # [B, K, C + R]
        key_positions = first_page * cache.page_size + jnp.arange(block_tokens, dtype=jnp.int32)
        visible = visible_keys(key_positions, query_positions, held)
        scores = jnp.where(visible, latent_scores(q_latent, q_rope, latents, scale=scale), -jnp.inf)
        return online_softmax_update(state, scores, latents[..., :rank], q_nope.dtype)

    trips = blocks_to_read(query_positions, held, block_tokens)
    state = jax.lax.fori_loop(0, trips, add_block, online_softmax_start(q_latent))
    return expand_values(online_softmax_result(state).astype(q_nope.dtype), value_up)


def _fan_in_init(in_axis, out_axis, axes: tuple[str | None, ...]):
    """Truncated-normal fan-in initialiser for a multi-axis kernel, annotated with `axes`."""
    init = nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )
    return logical(init, axes)


class GatedMLA(nnx.Module):
    """Gated MLA layer (no positional encoding).

    `__call__(x)` is the training path; `__call__(x, cache=c)` appends x's latents to the paged
    cache `c` and attends in the latent space over the pages each row holds
    (`paged_latent_attention`; prefill chunks or decode steps), returning `(y, new_cache)`.
    """

    def __init__(
        self,
        d_model: int,
        cfg: MLAConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.cfg = cfg
        self.dtype = dtype
        heads = cfg.num_heads
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        linear_init = nnx.initializers.lecun_normal()
        if cfg.q_lora_rank is None:
            self.q_down, self.q_norm = None, None
            query_source, query_source_axis = d_model, "embed"
        else:
            self.q_down = nnx.Linear(
                d_model,
                cfg.q_lora_rank,
                use_bias=False,
                kernel_init=logical(linear_init, ("embed", "latent")),
                **common,
            )
            self.q_norm = RMSNorm(
                cfg.q_lora_rank, eps=cfg.norm_eps, axis_name="latent", dtype=dtype,
                param_dtype=param_dtype,
            )
            query_source, query_source_axis = cfg.q_lora_rank, "latent"
        self.q_up = nnx.Einsum(
            "btc,chk->bthk",
            (query_source, heads, cfg.qk_head_dim),
            kernel_init=_fan_in_init(0, (1, 2), (query_source_axis, "heads", "kv")),
            **common,
        )
        self.kv_down = nnx.Linear(
            d_model,
            cfg.latent_dim,
            use_bias=False,
            kernel_init=logical(linear_init, ("embed", "latent")),
            **common,
        )
        self.kv_norm = RMSNorm(
            cfg.kv_lora_rank, eps=cfg.norm_eps, axis_name="latent", dtype=dtype,
            param_dtype=param_dtype,
        )
        self.kv_up = nnx.Einsum(
            "bsc,chk->bshk",
            (cfg.kv_lora_rank, heads, cfg.qk_nope_head_dim + cfg.v_head_dim),
            kernel_init=_fan_in_init(0, (1, 2), ("latent", "heads", "kv")),
            **common,
        )
        self.gate = (
            nnx.Einsum(
                "btd,dhv->bthv",
                (d_model, heads, cfg.v_head_dim),
                kernel_init=_fan_in_init(0, (1, 2), ("embed", "heads", "kv")),
                **common,
            )
            if cfg.output_gate
            else None
        )
        self.out = nnx.Einsum(
            "bthv,hvd->btd",
            (heads, cfg.v_head_dim, d_model),
            kernel_init=_fan_in_init((0, 1), 2, ("heads", "kv", "embed")),
            **common,
        )

    def _queries(self, x: jax.Array) -> jax.Array:
        """x: [B, T, d] -> q: [B, T, H, N + R]."""
        if self.q_down is None:
            return self.q_up(x)
        return self.q_up(self.q_norm(self.q_down(x)))

    def _latents(self, x: jax.Array) -> jax.Array:
        """x: [B, T, d] -> [normed c_kv ; k_r]: [B, T, C + R] (what the cache stores)."""
        c_kv, k_rope = jnp.split(self.kv_down(x), [self.cfg.kv_lora_rank], axis=-1)
        return jnp.concatenate([self.kv_norm(c_kv), k_rope.astype(self.dtype)], axis=-1)

    def _gated_output(self, x: jax.Array, o: jax.Array) -> jax.Array:
        """Per-head elementwise sigmoid gate from the layer input, then W_o. o: [B, T, H, V]."""
        if self.gate is None:
            return self.out(o.astype(self.dtype))
        gate = jax.nn.sigmoid(self.gate(x).astype(jnp.float32))
        return self.out((o.astype(jnp.float32) * gate).astype(self.dtype))

    def _implementation(self) -> AttentionImplementation:
        if self.cfg.implementation is not None:
            return self.cfg.implementation
        return default_implementation(self.dtype, max(self.cfg.qk_head_dim, self.cfg.v_head_dim))

    def __call__(
        self,
        x: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        cache: PagedLatentCache | None = None,
    ) -> jax.Array | tuple[jax.Array, PagedLatentCache]:
        """x: [B, T, d] -> y: [B, T, d], or (y, cache) when a cache is given.

        segment_ids: [B, T] int, documents of a packed row (training path only; a cached row is
        one sequence).
        """
        cfg = self.cfg
        q = self._queries(x)
        latents = self._latents(x)
        if cache is None and context_shards() > 1:
            implementation = self._implementation()
            if implementation == "cudnn_segments":  # no offset queries: the dense mask instead
                implementation = backend_implementation(self.dtype)
            o = context_parallel_attention(q, latents, self.kv_up.kernel[...], segment_ids,
                                           cfg=cfg, implementation=implementation)
            return self._gated_output(x, o)
        if cache is None:
            k_nope, v = jnp.split(self.kv_up(latents[..., : cfg.kv_lora_rank]),
                                  [cfg.qk_nope_head_dim], axis=-1)
            k_rope = jnp.broadcast_to(
                latents[:, :, None, cfg.kv_lora_rank :],
                k_nope.shape[:-1] + (cfg.qk_rope_head_dim,),
            )
            o = causal_document_attention(
                q,
                jnp.concatenate([k_nope, k_rope], axis=-1),
                v,
                scale=cfg.softmax_scale,
                segment_ids=segment_ids,
                implementation=self._implementation(),
                max_segments=cfg.max_segments,
            )
            return self._gated_output(x, o)
        if segment_ids is not None:
            raise ValueError(
                "segment_ids must be None with a cache: each cached row holds one sequence"
            )
        query_positions = cache.lengths[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)
        cache = cache.append(latents)
        q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
        o = paged_latent_attention(
            q_nope,
            q_rope,
            cache,
            self.kv_up.kernel[...],
            query_positions,
            scale=cfg.softmax_scale,
            pages_per_block=cfg.cache_pages_per_block,
        )
        return self._gated_output(x, o), cache
