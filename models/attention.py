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
cuDNN skips the tiles between documents; elsewhere through `jax.nn.dot_product_attention` (cuDNN on
other GPUs, XLA otherwise), packed documents kept apart by a dense [B, 1, T, T] mask.
Decoding runs in the latent space: W_kvb's key half is absorbed into the query and its value half
applied after the weighted sum, so the cache holds only [c_kv ; k_r] (C + R = 576 numbers per
token at full size) in a paged pool (`models.paged_cache`).
"""

import dataclasses
from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fused

from kda.common import document_index, document_starts
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

    def __post_init__(self):
        names = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "max_segments")
        if self.q_lora_rank is not None:
            names += ("q_lora_rank",)
        for name in names:
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {value!r}")
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


def _dense_document_attention(q, k, v, *, scale, document_ids, implementation):
    """Causal attention within equal `document_ids` [B, T] (or none), as a dense [B, 1, T, T]
    mask; q, k, v of one head size."""
    mask = None
    if document_ids is not None:
        mask = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                        implementation=implementation)


def packed_cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: DocumentSegments, *, scale: float
) -> jax.Array:
    """Causal attention within the documents `segments` describes, by cuDNN's packed layout.

    q, k, v: [B, T, H, D] (one head size, BTNH: jax's wrapper converts the offsets to element
    strides assuming BTNH, and scales both key and value offsets by the key's head size, so v must
    not be narrower) -> [B, T, H, D]. Every row must fit (`segments.fits`); tokens outside the
    described documents are not computed. Call `causal_document_attention` for a safe entry.
    """
    return cudnn_fused.dot_product_attention(
        q, k, v,
        q_seqlen=segments.lengths, kv_seqlen=segments.lengths,
        q_offsets=segments.offsets, kv_offsets=segments.offsets,
        scale=scale, mask_type=cudnn_fused.MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
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


def _segmented_attention(q, k, v, *, scale, segment_ids, max_segments):
    """The "cudnn_segments" path of `causal_document_attention` (q, k, v of one head size)."""
    if not is_positive_int(max_segments):
        raise ValueError(f"implementation='cudnn_segments' needs max_segments, a positive int "
                         f"(MLAConfig.max_segments), got {max_segments!r}")
    _require_packed_cudnn(q)
    # cuDNN on the GPUs that pass the checks above.
    dense_implementation = backend_implementation(q.dtype)
    if segment_ids is None:
        return _dense_document_attention(q, k, v, scale=scale, document_ids=None,
                                         implementation=dense_implementation)
    if segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids must be [B, T] = {q.shape[:2]} like q, got "
                         f"{segment_ids.shape}")
    segments = document_segments(segment_ids, max_segments)
    # The dense path keeps documents as runs too, so that both branches compute the same thing
    # whatever the ids (the dense mask alone would join two runs of one id).
    document_ids = document_index(segment_ids)

    def dense(q, k, v):
        return _dense_document_attention(q, k, v, scale=scale, document_ids=document_ids,
                                         implementation=dense_implementation)

    # M sizes the cuDNN call (its softmax statistics are [B * M, H, T]), so it is static, and a
    # row with more documents cannot be described. Rather than ever computing such a row wrong,
    # the whole call falls back to the dense mask: both programs are compiled, one runs. (M = T
    # would always fit but launches B * T mostly empty segments.)
    return jax.lax.cond(
        jnp.all(segments.fits),
        lambda q, k, v: packed_cudnn_attention(q, k, v, segments, scale=scale),
        dense, q, k, v,
    )


def causal_document_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    segment_ids: jax.Array | None = None,
    implementation: AttentionImplementation | None = None,
    max_segments: int | None = None,
) -> jax.Array:
    """Causal softmax attention, restricted to one document when `segment_ids` is given.

    q, k: [B, T, H, Dqk]; v: [B, T, H, Dv]; segment_ids: [B, T] int -> [B, T, H, Dv].

    implementation: "xla" (or None) and "cudnn" mask every pair of tokens whose ids differ with a
        dense [B, 1, T, T] mask; "cudnn_segments" (Hopper GPUs, 16-bit inputs) runs cuDNN's packed
        layout over each row's documents, runs of equal ids (`document_segments`), when every row
        holds at most `max_segments` of them, and the dense mask through cuDNN otherwise. For rows
        whose ids increase along the row, as the packer writes them, the two agree.
    max_segments: M of "cudnn_segments" (`MLAConfig.max_segments`); the dense paths ignore it.
    """
    q_padded, k_padded, v_padded = pad_head_dims(q, k, v)
    if implementation == "cudnn_segments":
        out = _segmented_attention(q_padded, k_padded, v_padded, scale=scale,
                                   segment_ids=segment_ids, max_segments=max_segments)
    else:
        out = _dense_document_attention(q_padded, k_padded, v_padded, scale=scale,
                                        document_ids=segment_ids, implementation=implementation)
    return out[..., : v.shape[-1]]


def absorbed_latent_attention(
    q_nope: jax.Array,
    q_rope: jax.Array,
    latents: jax.Array,
    kv_up: jax.Array,
    query_positions: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """MLA attention computed in the latent space, as used with the cache.

    q_nope: [B, T, H, N], q_rope: [B, T, H, R]; latents: [B, S, C + R] ([c_kv ; k_r] of every
    cached position); kv_up: [C, H, N + V] (W_kvb); query_positions: [B, T] int32, the position of
    each query, which sees keys at positions <= its own. -> [B, T, H, V].
    """
    kv_lora_rank = latents.shape[-1] - q_rope.shape[-1]
    key_up, value_up = jnp.split(kv_up, [q_nope.shape[-1]], axis=-1)  # [C, H, N], [C, H, V]
    c_kv, k_rope = jnp.split(latents, [kv_lora_rank], axis=-1)
    q_latent = jnp.einsum("bthn,chn->bthc", q_nope, key_up.astype(q_nope.dtype))
    scores = jnp.einsum(
        "bthc,bsc->bhts", q_latent, c_kv.astype(q_latent.dtype), preferred_element_type=jnp.float32
    ) + jnp.einsum(
        "bthr,bsr->bhts", q_rope, k_rope.astype(q_rope.dtype), preferred_element_type=jnp.float32
    )
    key_positions = jnp.arange(latents.shape[1], dtype=jnp.int32)
    visible = key_positions[None, None, None, :] <= query_positions[:, None, :, None]
    probs = jax.nn.softmax(jnp.where(visible, scores * scale, -jnp.inf), axis=-1)
    out_latent = jnp.einsum("bhts,bsc->bthc", probs.astype(q_nope.dtype), c_kv.astype(q_nope.dtype))
    return jnp.einsum("bthc,chv->bthv", out_latent, value_up.astype(q_nope.dtype))


def _fan_in_init(in_axis, out_axis, axes: tuple[str | None, ...]):
    """Truncated-normal fan-in initialiser for a multi-axis kernel, annotated with `axes`."""
    init = nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )
    return logical(init, axes)


class GatedMLA(nnx.Module):
    """Gated MLA layer (no positional encoding).

    `__call__(x)` is the training path; `__call__(x, cache=c)` appends x's latents to the paged
    cache `c` and attends in the latent space (prefill of a fresh sequence or decode steps),
    returning `(y, new_cache)`.
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
        o = absorbed_latent_attention(
            q_nope,
            q_rope,
            cache.gather(),
            self.kv_up.kernel[...],
            query_positions,
            scale=cfg.softmax_scale,
        )
        return self._gated_output(x, o), cache
