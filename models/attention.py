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

Training runs through `jax.nn.dot_product_attention` (cuDNN on GPU, XLA elsewhere). Decoding runs
in the latent space: W_kvb's key half is absorbed into the query and its value half applied after
the weighted sum, so the cache holds only [c_kv ; k_r] (C + R = 576 numbers per token at full
size) in a paged pool (`models.paged_cache`).
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from models.norms import RMSNorm
from models.paged_cache import PagedLatentCache
from models.sharding import logical

AttentionImplementation = Literal["xla", "cudnn"]


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
    # None picks cuDNN on GPU for 16-bit compute and XLA otherwise.
    implementation: AttentionImplementation | None = None

    def __post_init__(self):
        names = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            names += ("q_lora_rank",)
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {value!r}")
        if self.implementation not in (None, "xla", "cudnn"):
            raise ValueError(
                "MLAConfig.implementation must be None, 'xla' or 'cudnn', "
                f"got {self.implementation!r}"
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


def causal_document_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    segment_ids: jax.Array | None = None,
    implementation: AttentionImplementation | None = None,
) -> jax.Array:
    """Causal softmax attention, restricted to one document when `segment_ids` is given.

    q, k: [B, T, H, Dqk]; v: [B, T, H, Dv]; segment_ids: [B, T] int -> [B, T, H, Dv].
    """
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    # dot_product_attention wants one head size for q, k and v; zero padding changes neither the
    # scores (padded q/k) nor the output (padded v, sliced off).
    width = max(qk_dim, v_dim)

    def pad(t: jax.Array) -> jax.Array:
        return jnp.pad(t, [(0, 0)] * 3 + [(0, width - t.shape[-1])])

    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [B, 1, T, T]
    out = jax.nn.dot_product_attention(
        pad(q),
        pad(k),
        pad(v),
        mask=mask,
        scale=scale,
        is_causal=True,
        implementation=implementation,
    )
    return out[..., :v_dim]


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
        sixteen_bit = jnp.dtype(self.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn" if jax.default_backend() == "gpu" and sixteen_bit else "xla"

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
