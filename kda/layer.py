"""The KDA token mixer as a Flax NNX layer, with a prefill/decode cache.

    x [B, T, D] -> q|k|v projection -> causal depthwise conv (width 4) -> SiLU
                -> q, k [B, T, H, K] (L2-normalised inside the op), v [B, T, HV, V]
    decay gate g [B, T, HV, K] (lower-bound or softplus form, `kda.gate`), beta = sigmoid(linear)
    o = kda_attention(q, k, v, g, beta) -> head-wise RMSNorm -> * sigmoid(output gate) -> o_proj

With the tokens split over a `seq` mesh axis (context parallelism, `core.context_parallel`), a
sequence's first call convolves each shard from the previous shard's last `conv_size - 1`
projected inputs (`context_parallel_conv`) and runs the op across shards
(`kda.context_parallel`); calls with a cache are left to `jit`'s partitioning.

A `KDACache` holds what a continuation needs: the last `conv_size - 1` projected inputs (the
convolution's receptive field) and the float32 recurrent state. Feeding a sequence in pieces with
the cache (prefill, then one-token decode steps) gives the same outputs as one full call.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from core.context_parallel import context_shards, over_token_shards, previous_tokens
from core.norms import rms_norm
from core.sharding import arrays_are_whole_on_each_device, logical, logical_param
from kda.api import available_implementations, kda_attention
from kda.common import document_index
from kda.context_parallel import context_parallel_kda
from kda.gate import check_lower_bound, lower_bound_gate, softplus_gate
from kda.kernels.triton import short_conv
from kda.segments import is_segment_size, kda_attention_in_segments

GATES = ("lower_bound", "softplus")


def _replicated(value):
    """A small parameter with no shardable axis (logical names all None)."""
    return logical_param(value, (None,) * value.ndim)


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Shape and options of one KDA layer.

    Attributes:
      num_heads: H, query/key heads.
      head_dim: K = V, the key and value width of a head.
      num_value_heads: HV, a multiple of H (grouped value heads); None means H.
      conv_size: width of the causal depthwise convolution on q, k and v.
      gate: "lower_bound" (Kimi K3) or "softplus" (Kimi-Linear).
      gate_lower_bound: L in [-5, 0) for the lower-bound gate.
      full_rank_gate: decay-gate projection D -> HV*K directly (K3) instead of the low-rank
        D -> K -> HV*K (Kimi-Linear).
      norm_eps: epsilon of the head-wise output RMSNorm.
      impl: KDA implementation for sequences longer than one token (see `kda.kda_attention`).
      conv_kernels: run the short convolution and SiLU of a sequence's first call as Pallas
        kernels (`kda.kernels.triton.short_conv`, via `conv_silu_parts`) where they run; elsewhere
        no effect. They are more accurate than XLA's path (SiLU in float32, the filter's gradient
        never in bf16) and faster in the training step, where they also spare the backward XLA's
        recomputed forward (`benchmarks/short_conv_h200.md`, `benchmarks/train_h200.md`).
      check_inputs: debugging aid, passed to `kda.kda_attention`: raise when the decay gate
        breaks its promise (a NaN, a gate above 0, or one below `gate_lower_bound` with the
        lower-bound gate), also inside `jit`; the host then waits for the gates on every call.
      segment_tokens: run the op over calls (with context parallelism: shards) longer than this
        in recomputed segments of this many tokens (`kda.segments`; a positive multiple of 64
        that divides the call's or the shard's length): the backward keeps one segment's
        residuals instead of the sequence's, for one more forward. None: the whole call at once.
    """

    num_heads: int
    head_dim: int
    num_value_heads: int | None = None
    conv_size: int = 4
    gate: str = "lower_bound"
    gate_lower_bound: float = -5.0
    full_rank_gate: bool = False
    norm_eps: float = 1e-5
    impl: str = "auto"
    conv_kernels: bool = True
    check_inputs: bool = False
    segment_tokens: int | None = None

    def __post_init__(self):
        if self.num_value_heads is None:
            object.__setattr__(self, "num_value_heads", self.num_heads)
        for name in ("num_heads", "head_dim", "num_value_heads", "conv_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KDAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_value_heads % self.num_heads:
            raise ValueError(
                f"KDAConfig.num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"num_heads ({self.num_heads})"
            )
        for name in ("conv_kernels", "check_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KDAConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.segment_tokens is not None and not is_segment_size(self.segment_tokens):
            raise ValueError(f"KDAConfig.segment_tokens must be None or a positive multiple of "
                             f"64, got {self.segment_tokens!r}")
        if self.gate not in GATES:
            raise ValueError(f"KDAConfig.gate must be one of {GATES}, got {self.gate!r}")
        if self.impl not in available_implementations():
            raise ValueError(
                f"KDAConfig.impl must be one of {available_implementations()} (registered KDA "
                f"implementations; 'auto' picks one per call), got {self.impl!r}"
            )
        if self.gate == "lower_bound":
            check_lower_bound(self.gate_lower_bound, "KDAConfig.gate_lower_bound")

    @property
    def qkv_dim(self) -> int:
        """Width of the fused q|k|v projection: 2*H*K + HV*V."""
        return (2 * self.num_heads + self.num_value_heads) * self.head_dim


class KDACache(NamedTuple):
    """State carried between calls. conv: [B, conv_size - 1, qkv_dim]; state: f32 [B, HV, K, V]."""

    conv: jax.Array
    state: jax.Array


def count_kda_params(d_model: int, cfg: KDAConfig) -> int:
    """Number of parameters of `KDA(d_model, cfg)`, computed without building it."""
    key_width = cfg.num_value_heads * cfg.head_dim
    gate = d_model * key_width if cfg.full_rank_gate else (d_model + key_width) * cfg.head_dim
    output_gate = (d_model + key_width) * cfg.head_dim + key_width  # low rank, bias on the up
    return (
        d_model * cfg.qkv_dim  # q|k|v projection
        + cfg.conv_size * cfg.qkv_dim  # depthwise conv
        + gate
        + cfg.num_value_heads * (1 + cfg.head_dim)  # A_log, dt_bias
        + d_model * cfg.num_value_heads  # beta projection
        + output_gate
        + cfg.head_dim  # output RMSNorm weight
        + key_width * d_model  # output projection
    )


def causal_depthwise_conv(x, weight, prefix, segment_ids=None, prefix_segment_ids=None):
    """Causal depthwise convolution that never mixes tokens of different packed documents.

    Args:
      x: [B, T, C] inputs.
      weight: [W, C], `weight[-1]` multiplies the current token.
      prefix: [B, W - 1, C], the inputs preceding x (zeros at the start of a sequence).
      segment_ids: integer [B, T] or None.
      prefix_segment_ids: integer [B, W - 1], the prefix's ids (documents are runs of equal ids
        across the prefix and x), or None: the prefix counts as part of the first document.
    Returns:
      (y [B, T, C], new_prefix [B, W - 1, C]: the last W - 1 inputs, for the next call).
    """
    width, length = weight.shape[0], x.shape[1]
    padded = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)  # [B, W - 1 + T, C]
    document = None
    if segment_ids is not None:
        if prefix_segment_ids is None:
            prefix_segment_ids = jnp.broadcast_to(segment_ids[:, :1], prefix.shape[:2])
        padded_document = document_index(jnp.concatenate([prefix_segment_ids, segment_ids], 1))
        document = padded_document[:, width - 1:]
    # Summed in float32 and rounded once. The sum's transpose is the weight's gradient, a sum over
    # every token of the batch, which bfloat16 accumulation would get visibly wrong.
    y = jnp.zeros(x.shape, jnp.float32)
    for offset in range(width):  # W is 4: an unrolled sum of shifted copies
        window = padded[:, offset:offset + length]
        if document is not None:
            same = padded_document[:, offset:offset + length] == document
            window = jnp.where(same[..., None], window, 0)
        y = y + window.astype(jnp.float32) * weight[offset].astype(jnp.float32)
    return y.astype(x.dtype), padded[:, length:]


def context_parallel_conv(x, weight, segment_ids=None):
    """`causal_depthwise_conv` from a zero prefix with the tokens split over the current mesh's
    `seq` axis (called under `jax.set_mesh`, outside `shard_map`): each shard's prefix is the
    previous shard's last W - 1 inputs and their ids (`previous_tokens`: one ppermute; zeros
    on the first shard).

    x: [B, T, C]; weight: [W, C]; segment_ids: integer [B, T] or None -> y [B, T, C]. T must
    divide by the `seq` axis size, into shards of at least W - 1 tokens.
    """
    count = weight.shape[0] - 1

    def on_shard(x, weight, segment_ids):
        prefix_ids = None if segment_ids is None else previous_tokens(segment_ids, count)
        return causal_depthwise_conv(x, weight, previous_tokens(x, count), segment_ids,
                                     prefix_ids)[0]

    tokens = ("batch", "seq", "heads")
    return over_token_shards(on_shard, in_names=(tokens, (None, "heads"), tokens[:2]),
                             out_names=tokens, batch=x.shape[0], length=x.shape[1],
                             heads=x.shape[2])(x, weight, segment_ids)


def conv_silu_parts(x, weight, segment_ids, widths, *, kernels: bool | None = None):
    """SiLU of the causal depthwise convolution of x from a zero prefix (a sequence's first call),
    split along channels into parts of `widths` (q, k, v).

    x: [B, T, C]; weight: [W, C]; segment_ids: integer [B, T] or None. Returns a tuple of
    [B, T, width] in x.dtype.

    With the tokens split over a `seq` mesh axis, `context_parallel_conv` (and no kernels).
    kernels: None runs Pallas kernels where `short_conv_kernel_runs` (a GPU, shapes that
    `kda.kernels.triton.short_conv.refusal` accepts, arrays whole on the device): they read x once
    and write the parts (the backward: dx and the weight's gradient), the SiLU taken in float32
    before one rounding. Otherwise, or with False: `causal_depthwise_conv`, the SiLU in x.dtype,
    and a split. True asks for the kernels whatever the backend.
    """
    if context_shards() > 1:
        return _split_channels(jax.nn.silu(context_parallel_conv(x, weight, segment_ids)), widths)
    if kernels is None:
        kernels = short_conv_kernel_runs(x.shape, widths, weight.shape[0])
    if kernels:
        document = None if segment_ids is None else document_index(segment_ids)
        return _conv_silu_kernels(x, weight, document, tuple(widths))
    prefix = jnp.zeros((x.shape[0], weight.shape[0] - 1, x.shape[2]), x.dtype)
    mixed, _ = causal_depthwise_conv(x, weight, prefix, segment_ids)
    return _split_channels(jax.nn.silu(mixed), widths)


def _split_channels(x, widths):
    """x [..., sum(widths)] split along its last axis into parts of `widths`."""
    bounds = [sum(widths[:i]) for i in range(1, len(widths))]
    return tuple(jnp.split(x, bounds, axis=-1))


def short_conv_kernel_runs(x_shape, widths, width) -> bool:
    """Whether `conv_silu_parts` runs its Pallas kernels for x of `x_shape`."""
    return (jax.default_backend() == "gpu"
            and short_conv.refusal(tuple(x_shape), tuple(widths), width) is None
            and arrays_are_whole_on_each_device())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_silu_kernels(x, weight, document, widths):
    return short_conv.conv_silu_forward(x, weight, document, widths)


def _conv_silu_kernels_forward(x, weight, document, widths):
    return _conv_silu_kernels(x, weight, document, widths), (x, weight, document)


def _conv_silu_kernels_backward(widths, residuals, grads):
    x, weight, document = residuals
    dx, d_weight = short_conv.conv_silu_backward(x, weight, document, tuple(grads))
    return dx, d_weight.astype(weight.dtype), None


_conv_silu_kernels.defvjp(_conv_silu_kernels_forward, _conv_silu_kernels_backward)


def _dt_bias_init(key, shape, dtype=jnp.float32):
    """Mamba-style: softplus(dt_bias) = dt with dt log-uniform in [1e-3, 1e-1]."""
    dt = jnp.exp(jax.random.uniform(key, shape, minval=jnp.log(1e-3), maxval=jnp.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # inverse softplus


class KDA(nnx.Module):
    """Kimi Delta Attention layer: x [B, T, D] -> [B, T, D]."""

    def __init__(self, d_model: int, cfg: KDAConfig, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        head_dim, value_heads = cfg.head_dim, cfg.num_value_heads
        key_width = value_heads * head_dim
        init = nnx.initializers.lecun_normal()

        def linear(d_in, d_out, axes, use_bias=False):
            return nnx.Linear(d_in, d_out, use_bias=use_bias, dtype=dtype,
                              param_dtype=param_dtype,
                              kernel_init=logical(init, axes),
                              bias_init=logical(nnx.initializers.zeros, axes[1:]),
                              rngs=rngs)

        self.qkv_proj = linear(d_model, cfg.qkv_dim, ("embed", "heads"))
        bound = cfg.conv_size ** -0.5
        conv_init = functools.partial(jax.random.uniform, minval=-bound, maxval=bound)
        self.conv_weight = nnx.Param(logical(conv_init, (None, "heads"))(
            rngs.params(), (cfg.conv_size, cfg.qkv_dim), param_dtype))
        if cfg.full_rank_gate:
            self.gate_proj = linear(d_model, key_width, ("embed", "heads"))
        else:
            self.gate_proj = nnx.Sequential(linear(d_model, head_dim, ("embed", None)),
                                            linear(head_dim, key_width, (None, "heads")))
        # The lower-bound gate starts at rate exp(0) = 1; the softplus gate at Kimi-Linear's
        # log U(1, 16).
        if cfg.gate == "lower_bound":
            A_log = jnp.zeros((value_heads,), param_dtype)
        else:
            A_log = jnp.log(jax.random.uniform(rngs.params(), (value_heads,), param_dtype, 1, 16))
        self.A_log = _replicated(A_log)
        self.dt_bias = _replicated(_dt_bias_init(rngs.params(), (value_heads, head_dim),
                                                 param_dtype))
        self.beta_proj = linear(d_model, value_heads, ("embed", None))
        self.out_gate = nnx.Sequential(linear(d_model, head_dim, ("embed", None)),
                                       linear(head_dim, key_width, (None, "heads"), True))
        self.out_norm_weight = _replicated(jnp.ones((head_dim,), param_dtype))
        self.o_proj = linear(key_width, d_model, ("heads", "embed"))

    def init_cache(self, batch_size: int) -> KDACache:
        """An empty cache: the state of a sequence before its first token."""
        cfg = self.cfg
        return KDACache(
            conv=jnp.zeros((batch_size, cfg.conv_size - 1, cfg.qkv_dim), self.dtype),
            state=jnp.zeros((batch_size, cfg.num_value_heads, cfg.head_dim, cfg.head_dim),
                            jnp.float32),
        )

    def _decay(self, x):
        """Log-decay g, float32 [B, T, HV, K]."""
        cfg = self.cfg
        f = self.gate_proj(x).reshape(*x.shape[:2], cfg.num_value_heads, cfg.head_dim)
        if cfg.gate == "lower_bound":
            return lower_bound_gate(f, self.A_log[...], self.dt_bias[...], cfg.gate_lower_bound)
        return softplus_gate(f, self.A_log[...], self.dt_bias[...])

    def __call__(self, x, *, segment_ids=None, cache: KDACache | None = None,
                 return_cache: bool = False):
        """Mixes tokens causally.

        Args:
          x: [B, T, D].
          segment_ids: integer [B, T] or None; packed documents never see each other.
          cache: a `KDACache` to continue from (None: start of the sequences).
          return_cache: also return the cache after the last token.
        Returns:
          y [B, T, D] in the compute dtype, or (y, cache) if `return_cache`.
        """
        cfg = self.cfg
        batch, length, _ = x.shape
        x = x.astype(self.dtype)
        key_width = cfg.num_heads * cfg.head_dim
        widths = (key_width, key_width, cfg.qkv_dim - 2 * key_width)
        projected = self.qkv_proj(x)
        if cache is None and not return_cache:  # a sequence's first call: zero prefix
            q, k, v = conv_silu_parts(projected, self.conv_weight[...], segment_ids, widths,
                                      kernels=None if cfg.conv_kernels else False)
        else:
            conv_prefix = self.init_cache(batch).conv if cache is None else cache.conv
            mixed, conv_tail = causal_depthwise_conv(projected, self.conv_weight[...],
                                                     conv_prefix, segment_ids)
            q, k, v = _split_channels(jax.nn.silu(mixed), widths)
        q = q.reshape(batch, length, cfg.num_heads, cfg.head_dim)
        k = k.reshape(batch, length, cfg.num_heads, cfg.head_dim)
        v = v.reshape(batch, length, cfg.num_value_heads, cfg.head_dim)
        beta = jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
        attend = kda_attention
        # The tokens of a device: the call's, or one shard's on the training path (whose first
        # call splits them over a seq mesh axis, `kda.context_parallel`).
        shards = context_shards() if cache is None and not return_cache else 1
        if cfg.segment_tokens is not None and length // shards > cfg.segment_tokens:
            attend = functools.partial(kda_attention_in_segments,
                                       segment_tokens=cfg.segment_tokens)
        if shards > 1:
            attend = functools.partial(context_parallel_kda, attend=attend)
        o, state = attend(
            q, k, v, self._decay(x), beta, initial_state=None if cache is None else cache.state,
            output_final_state=return_cache, segment_ids=segment_ids, use_qk_l2norm=True,
            gate_lower_bound=cfg.gate_lower_bound if cfg.gate == "lower_bound" else None,
            # One token is one recurrence step: the chunked op would pad it to a whole chunk.
            impl="reference" if length == 1 else cfg.impl, check_inputs=cfg.check_inputs,
        )
        gate = self.out_gate(x).reshape(o.shape).astype(jnp.float32)
        o = rms_norm(o, self.out_norm_weight[...], cfg.norm_eps, dtype=jnp.float32)
        o = o * jax.nn.sigmoid(gate)
        y = self.o_proj(o.reshape(batch, length, -1).astype(self.dtype))
        return (y, KDACache(conv_tail, state)) if return_cache else y
