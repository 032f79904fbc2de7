"""The hybrid decoder: KDA and Gated MLA token mixers, dense then Stable LatentMoE FFNs, AttnRes.

    tokens -> embedding -> [layer 0 .. L-1] -> AttnRes read -> RMSNorm -> LM head -> logits

    layer l:  x = READ(stream);  stream += mixer_l(RMSNorm(x))     mixer: KDA or Gated MLA
              x = READ(stream);  stream += ffn_l(RMSNorm(x))       ffn: dense GLU or MoE

READ and the stream bookkeeping are `models.attn_res` (Block AttnRes, Full AttnRes or plain
residuals). Parameters are float32 by default and computation runs in `cfg.dtype`; logits are
float32. With `cfg.scan_layers`, each run of identical layer groups (K3: [KDA, KDA, MLA, KDA]
x 22) is one stacked module applied with `lax.scan`; `cfg.remat` sets what the backward pass
recomputes of each layer, scanned or not.

    model = HybridLM(preset("tiny"), rngs=nnx.Rngs(0))
    logits = model(tokens, segment_ids)                      # [B, T, vocab] float32
    logits, router_stats = model.forward(tokens, segment_ids) # stats for the MoE balancer
    hidden, router_stats = model.forward(tokens, segment_ids, return_hidden=True)  # head input
    logits = model(tokens, segment_ids, images)    # with cfg.vision: a models.vision.VisionBatch
    moe.experts.update_router_biases([layer for layer, _ in model.moe_sites()], router_stats)

With `cfg.vision`, `images` (the packed vision buffer) runs through the vision tower, merger and
projector, and the k-th image placeholder token (`cfg.vision.image_token_id`, row-major over the
batch) takes the k-th merged image token in place of its embedding
(`models.vision.merge_image_features`); without images the model is the text model.

Generation continues sequences through `DecodeState` (KDA conv/recurrent state, paged MLA
latents): `state = model.init_decode_state(...)`, then `logits, state = model.extend(tokens,
state)` for the prompt and for each new token (`models.generate` drives it;
`all_logits=False` runs the LM head on the last position only). A prompt with images is embedded
once, `embedded = model.embed_inputs(prompt, images)`, and its slices go to `extend(...,
embedded=...)` chunk by chunk (`models.prefill`), so the tower runs once per prompt.

Each part of the model (and of `train.step`) runs under a `jax.named_scope` of `PROFILE_SCOPES`
(`profile_scope`), so a profile can sum the compiled step's device time per part
(`experiments.profiling.scope_times`).
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kda.layer import KDA
from models.attention import GatedMLA
from models.attn_res import (
    AttnResRead,
    ResidualStream,
    num_seal_slots,
    sublayer_input,
)
from models.config import ModelConfig
from core.norms import RMSNorm
from models.paged_cache import PagedLatentCache, init_pages
from models.vision import VisionBatch, VisionEncoder, merge_image_features
from core.sharding import constrain, logical
from moe.experts import EXPERT_WEIGHTS_NAME, DenseFFN, StableLatentMoE
from moe.routing import PERMUTATION_NAME, RouterStats

# The primitives that launch the GPU kernels: Pallas (a Mosaic GPU kernel is an `mpmd_map`),
# cuDNN flash attention's forward.
KERNEL_PRIMITIVES = frozenset({"pallas_call", "mpmd_map", "dot_product_attention_fwd",
                               "dot_product_attention_fwd_wrapper"})


def launches_kernel(prim, **params) -> bool:
    """Whether an equation of `prim` with `params` runs one of `KERNEL_PRIMITIVES`, itself or in a
    jaxpr it calls: `plgpu.kernel` wraps its `mpmd_map` in a `custom_vmap_call`, and a custom VJP
    whose forward rule calls its own function (the MoE's grouped GEMM) is one `custom_vjp_call`
    there, which the checkpoint policy sees whole."""
    if prim.name in KERNEL_PRIMITIVES:
        return True
    return any(launches_kernel(eqn.primitive, **eqn.params)
               for jaxpr in _called_jaxprs(params) for eqn in jaxpr.eqns)


def _called_jaxprs(params):
    """The jaxprs among an equation's parameters (closed ones opened)."""
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)
            if hasattr(jaxpr, "eqns"):
                yield jaxpr


# What `dots_kernels` keeps by name besides: the MoE's routing and permutation, and its expert
# weights in the compute dtype.
_KEPT_NAMES = jax.checkpoint_policies.save_only_these_names(PERMUTATION_NAME, EXPERT_WEIGHTS_NAME)


def dots_and_kernels_saveable(prim, *avals, **params) -> bool:
    """The `dots_kernels` policy: matmul outputs, the GPU kernels' outputs, the MoE's routing
    and permutation (`moe.routing.PERMUTATION_NAME`: a top-k, a sort and gathers) and its expert
    weights cast to the compute dtype (`moe.experts.EXPERT_WEIGHTS_NAME`) are kept.

    A kernel's `custom_vjp` forward is opaque to the other policies, so under `dots` the backward
    pass ran every kernel's forward again to rebuild its residuals (KDA's preparation and
    recurrence, the MoE grouped GEMMs and cuDNN attention, each twice).
    A whole call that launches a kernel counts as one (`launches_kernel`): its outputs are kept.
    """
    return (jax.checkpoint_policies.checkpoint_dots(prim, *avals, **params)
            or launches_kernel(prim, **params)
            or _KEPT_NAMES(prim, *avals, **params))


# Each layer's live residual input, named so that a policy can move it off the device.
LAYER_INPUT_NAME = "layer_input"

REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_kernels": dots_and_kernels_saveable,
    # `full` with the layer inputs in pinned host memory from the forward pass to the backward
    # pass: the device holds one layer's recomputation and the AttnRes snapshots (inputs of many
    # layers, so they stay), not one [B, T, D] input per layer.
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT_NAME,),
        offload_src="device", offload_dst="pinned_host"),
}
STREAM_AXES = ("batch", "seq", "embed")
# The parts of a training step, each a `jax.named_scope` (`profile_scope`). A norm belongs to
# the part it feeds; the residual adds between sub-layers belong to none.
PROFILE_SCOPES = (
    "embed",         # token embedding
    "vision",        # vision tower, merger, projector, and the merge into the embeddings
    "attn_res",      # AttnRes reads and seals (models.attn_res), before each sub-layer and head
    "kda",           # KDA token mixer, its RMSNorm included
    "attention",     # Gated MLA token mixer, its RMSNorm included
    "dense_ffn",     # dense GLU FFN, its RMSNorm included
    "moe",           # Stable LatentMoE FFN, its RMSNorm included
    "lm_head",       # final RMSNorm and LM head
    "loss",          # cross-entropy and MoE auxiliary loss (train.step)
    "finite_check",  # gradient norm and the non-finite test (train.step)
    "optimizer",     # the optimizer update (train.step)
    "router_bias",   # the MoE router-bias update (train.step)
    "qk_clip",       # QK-Clip of the MLA heads, when on (train.step)
)


def profile_scope(part: str):
    """`jax.named_scope(part)` for one of `PROFILE_SCOPES` (the names a profile looks for)."""
    if part not in PROFILE_SCOPES:
        raise ValueError(f"part must be one of PROFILE_SCOPES {PROFILE_SCOPES}, got {part!r}")
    return jax.named_scope(part)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Layers first .. first + size * repeats - 1, as `repeats` copies of a `size`-layer group."""

    first: int
    size: int
    repeats: int

    @property
    def num_layers(self) -> int:
        return self.size * self.repeats


def layer_plan(cfg: ModelConfig) -> tuple[GroupPlan, ...]:
    """How the layers are grouped: runs of repeated groups (scanned) and single layers.

    The group size is the spacing of the full-attention layers (K3: 4), so a group is one period
    of the KDA/MLA pattern. Without `scan_layers` every layer is its own group.
    """
    kinds = tuple(zip(cfg.mixer_kinds, cfg.ffn_kinds))
    if not cfg.scan_layers:
        return tuple(GroupPlan(i, 1, 1) for i in range(cfg.num_layers))
    gaps = [b - a for a, b in zip(cfg.full_attn_layers, cfg.full_attn_layers[1:])]
    size = max(set(gaps), key=gaps.count) if gaps else 1
    plan, first = [], 0
    while first < cfg.num_layers:
        repeats = 1
        while kinds[first + repeats * size : first + (repeats + 1) * size] == (
            kinds[first : first + size]
        ):
            repeats += 1
        if repeats > 1:
            plan.append(GroupPlan(first, size, repeats))
            first += size * repeats
        else:
            plan.append(GroupPlan(first, 1, 1))
            first += 1
    return tuple(plan)


def _attn_res_read(cfg: ModelConfig) -> AttnResRead | None:
    """The parameters of one AttnRes read; none for plain residuals."""
    if cfg.residual == "plain":
        return None
    return AttnResRead(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.parameter_dtype)


class DecoderLayer(nnx.Module):
    """One layer: AttnRes read, RMSNorm, token mixer; AttnRes read, RMSNorm, FFN."""

    def __init__(self, cfg: ModelConfig, mixer: str, ffn: str, *, rngs: nnx.Rngs):
        d, eps = cfg.d_model, cfg.norm_eps
        dtypes = dict(dtype=cfg.compute_dtype, param_dtype=cfg.parameter_dtype)
        self.mixer_kind, self.ffn_kind = mixer, ffn
        self.mixer_read = _attn_res_read(cfg)
        self.mixer_norm = RMSNorm(d, eps=eps, axis_name="embed", **dtypes)
        if mixer == "kda":
            self.mixer = KDA(d, cfg.kda, rngs=rngs, **dtypes)
        else:
            self.mixer = GatedMLA(d, cfg.mla, rngs=rngs, **dtypes)
        self.ffn_read = _attn_res_read(cfg)
        self.ffn_norm = RMSNorm(d, eps=eps, axis_name="embed", **dtypes)
        if ffn == "dense":
            moe = cfg.moe
            self.ffn = DenseFFN(
                d, cfg.dense_hidden, moe.activation, situ_beta=moe.situ_beta,
                situ_linear_beta=moe.situ_linear_beta, swiglu_limit=moe.swiglu_limit, rngs=rngs,
                **dtypes,
            )
        else:
            self.ffn = StableLatentMoE(d, cfg.moe, rngs=rngs, **dtypes)

    def init_cache(self, batch_size: int, num_pages: int, page_size: int):
        """Empty per-sequence state: a `KDACache`, or a page pool for the MLA latents."""
        if self.mixer_kind == "kda":
            return self.mixer.init_cache(batch_size)
        return init_pages(num_pages, page_size, self.mixer.cfg.latent_dim, self.mixer.dtype)

    def __call__(self, stream, index, period, segment_ids, cache, page_table):
        """Applies layer `index` (0-based, int or traced) to the residual stream.

        cache: None (training) or this layer's cache; page_table: (block_tables, lengths).
        Returns (stream, RouterStats or None, new cache or None).
        """
        with profile_scope("attn_res"):
            x, stream = sublayer_input(stream, self.mixer_read, 2 * index, period)
        with profile_scope("kda" if self.mixer_kind == "kda" else "attention"):
            h = self.mixer_norm(x)
            if cache is None:
                mixed = self.mixer(h, segment_ids=segment_ids)
            elif self.mixer_kind == "kda":
                mixed, cache = self.mixer(h, cache=cache, return_cache=True)
            else:
                mixed, paged = self.mixer(h, cache=PagedLatentCache(cache, *page_table))
                cache = paged.pages
        stream = stream.add(mixed)
        with profile_scope("attn_res"):
            x, stream = sublayer_input(stream, self.ffn_read, 2 * index + 1, period)
        with profile_scope("moe" if self.ffn_kind == "moe" else "dense_ffn"):
            h = self.ffn_norm(x)
            stats = None
            if self.ffn_kind == "moe":
                out, stats = self.ffn(h, segment_ids)
            else:
                out = self.ffn(h)
        stream = stream.add(out)
        return dataclasses.replace(stream, live=constrain(stream.live, STREAM_AXES)), stats, cache


class LayerGroup(nnx.Module):
    """Consecutive layers applied in order (the unit that `lax.scan` repeats)."""

    def __init__(self, cfg: ModelConfig, first: int, size: int, *, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, cfg.mixer_kinds[i], cfg.ffn_kinds[i], rngs=rngs)
                for i in range(first, first + size)
            ]
        )

    def __call__(self, stream, first, period, segment_ids, caches, page_table, remat=None):
        """Returns (stream, per-layer RouterStats or None, per-layer caches or None).

        remat: a checkpoint policy (`REMAT`) applied to each layer on its own, or None.
        """
        all_stats, new_caches = [], []
        for offset, layer in enumerate(self.layers):
            cache = None if caches is None else caches[offset]
            stream, stats, cache = _rematted(layer, remat, period, segment_ids, page_table)(
                stream, first + offset, cache
            )
            all_stats.append(stats)
            new_caches.append(cache)
        return stream, tuple(all_stats), None if caches is None else tuple(new_caches)


def _stacked_group(cfg: ModelConfig, plan: GroupPlan, rngs: nnx.Rngs) -> LayerGroup:
    """`plan.repeats` independently initialised copies of a group, stacked on a leading axis."""

    @nnx.split_rngs(splits=plan.repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def build(rngs):
        return LayerGroup(cfg, plan.first, plan.size, rngs=rngs)

    return build(rngs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything a continuation needs, for a batch of sequences.

    caches: per layer group, per layer: a `KDACache` or the MLA page pool [N, page, latent]
      (stacked on a leading axis for scanned groups).
    block_tables: [B, max_pages_per_seq] int32, shared by every MLA layer (`models.paged_cache`).
    lengths: [B] int32 tokens consumed so far.
    """

    caches: tuple
    block_tables: jax.Array
    lengths: jax.Array


@jax.custom_vjp
def lm_head_logits(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """Logits [..., V] float32 of x [..., D] and kernel [D, V]: one product in x's dtype with
    float32 accumulation.

    Its backward rounds the float32 cotangent to x's dtype before both of its products, so they
    run at the forward's speed. JAX's own transpose would multiply the float32 cotangent by the
    bf16 operands, which XLA does as float32 products, several times slower than bf16 ones.
    Rounding d logits to bf16 is the precision of every other product's cotangent in the model;
    the weight gradient comes back float32-accumulated.
    """
    return jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)


def _lm_head_logits_fwd(x, kernel):
    return lm_head_logits(x, kernel), (x, kernel)


def _lm_head_logits_bwd(saved, d_logits):
    x, kernel = saved
    d_x, d_kernel = lm_head_backward(x, kernel, d_logits)
    return d_x, d_kernel.astype(kernel.dtype)


def lm_head_backward(x: jax.Array, kernel: jax.Array, d_logits: jax.Array):
    """The backward of `lm_head_logits`: d_logits [..., V] rounded to x's dtype, times kernel
    [D, V] (in x's dtype) and x [..., D]. Returns d x [..., D] in x's dtype and d kernel [D, V]
    float32 (for a caller that sums it over token chunks, `train.step.chunked_lm_head_nll`)."""
    d_logits = d_logits.astype(x.dtype)
    d_x = jnp.einsum("...v,dv->...d", d_logits, kernel.astype(x.dtype),
                     preferred_element_type=jnp.float32)
    d_kernel = jnp.einsum("...d,...v->dv", x, d_logits, preferred_element_type=jnp.float32)
    return d_x.astype(x.dtype), d_kernel


lm_head_logits.defvjp(_lm_head_logits_fwd, _lm_head_logits_bwd)


class LMHead(nnx.Module):
    """`lm_head_logits` of x [..., D] in `dtype` and a kernel [D, V] (logical axes embed, vocab)
    -> logits [..., V] float32."""

    def __init__(self, d_model: int, vocab_size: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        init = logical(nnx.initializers.lecun_normal(), ("embed", "vocab"))
        self.kernel = nnx.Param(init(rngs.params(), (d_model, vocab_size), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return lm_head_logits(x.astype(self.dtype), self.kernel[...])


class HybridLM(nnx.Module):
    """The hybrid decoder of `cfg`. `model(tokens [B, T] int32, segment_ids=None)` -> logits
    [B, T, vocab] float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.plan = layer_plan(cfg)
        d, dtypes = cfg.d_model, dict(dtype=cfg.compute_dtype, param_dtype=cfg.parameter_dtype)
        self.embed = nnx.Embed(
            cfg.vocab_size, d,
            embedding_init=logical(nnx.initializers.normal(1.0), ("vocab", "embed")),
            rngs=rngs, **dtypes,
        )
        self.groups = nnx.List(
            [
                LayerGroup(cfg, p.first, p.size, rngs=rngs)
                if p.repeats == 1
                else _stacked_group(cfg, p, rngs)
                for p in self.plan
            ]
        )
        self.final_read = _attn_res_read(cfg)
        self.final_norm = RMSNorm(d, eps=cfg.norm_eps, axis_name="embed", **dtypes)
        self.lm_head = LMHead(d, cfg.vocab_size, rngs=rngs, **dtypes)
        # Built last, so that the text model's parameters are those of the text-only config.
        self.vision = None if cfg.vision is None else VisionEncoder(
            cfg.vision, d, scan_layers=cfg.scan_layers, rngs=rngs, **dtypes)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 images: VisionBatch | None = None) -> jax.Array:
        """tokens: [B, T] int32; segment_ids: [B, T] packed-document ids; images: the vision
        buffer of the batch's image placeholders (`models.vision.VisionBatch`) -> [B, T, V]
        float32."""
        return self.forward(tokens, segment_ids, images=images)[0]

    def forward(
        self, tokens, segment_ids=None, *, images: VisionBatch | None = None,
        return_hidden: bool = False
    ) -> tuple[jax.Array, tuple[RouterStats, ...]]:
        """Logits [B, T, V] float32 and the RouterStats of every MoE layer, in `moe_sites` order
        (stacked on a leading axis for scanned groups).

        images: the vision buffer whose merged tokens replace the image placeholders' embeddings
        (needs `cfg.vision`), or None.
        return_hidden: return the LM head's input [B, T, D] (the final norm's output, in the
        compute dtype) instead of the logits, for a loss that applies `lm_head` itself
        (`train.step.chunked_lm_head_nll`).
        """
        outputs, stats, _ = self._run(tokens, segment_ids, None, images=images,
                                      return_hidden=return_hidden)
        return outputs, stats

    def extend(
        self, tokens: jax.Array, state: DecodeState, *, all_logits: bool = True,
        embedded: jax.Array | None = None,
    ) -> tuple[jax.Array, DecodeState]:
        """Appends tokens [B, T] to the sequences of `state` (a prompt, or one decoded token).

        The page table must already cover lengths + T tokens (`PageAllocator.reserve`). MLA layers
        read only the pages their rows hold (`models.attention.paged_latent_attention`).
        embedded: the tokens' decoder input [B, T, D] (`embed_inputs`), for a prompt with images
        (their tower runs once for the whole prompt, `models.prefill`); None embeds the tokens.
        Returns logits [B, T, V] float32 (all_logits) or the last position's [B, V], for which
        the LM head runs on that position alone, and the continued state.
        """
        logits, _, state = self._run(tokens, None, state, embedded=embedded,
                                     last_only=not all_logits)
        return logits, state

    def init_decode_state(
        self, batch_size: int, *, num_pages: int, page_size: int, max_pages_per_seq: int
    ) -> DecodeState:
        """Empty caches for `batch_size` sequences; MLA latents in a pool of `num_pages` pages."""
        caches = []
        for plan, group in zip(self.plan, self.groups):
            one = tuple(
                layer.init_cache(batch_size, num_pages, page_size) for layer in group.layers
            )
            if plan.repeats > 1:  # a scanned group's caches stack like its parameters
                one = jax.tree.map(lambda c: jnp.stack([c] * plan.repeats), one)
            caches.append(one)
        return DecodeState(
            caches=tuple(caches),
            block_tables=jnp.zeros((batch_size, max_pages_per_seq), jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )

    def embed_inputs(self, tokens: jax.Array, images: VisionBatch | None = None) -> jax.Array:
        """The decoder's input [B, T, D] in the compute dtype: the embeddings of tokens [B, T],
        the image placeholders' replaced by the merged image tokens of `images` (the tower,
        merger and projector run here; `merge_image_features`). images None: text only."""
        with profile_scope("embed"):
            embedded = constrain(self.embed(tokens), STREAM_AXES)
        if images is not None:
            if self.vision is None:
                raise ValueError("images were given to a model without a vision tower: build it "
                                 "from a ModelConfig with vision=VisionConfig(...)")
            with profile_scope("vision"):
                features, valid = self.vision(images, remat=REMAT[self.cfg.remat])
                is_image = tokens == self.cfg.vision.image_token_id
                embedded = constrain(merge_image_features(embedded, is_image, features, valid),
                                     STREAM_AXES)
        return embedded

    def _run(self, tokens, segment_ids, state: DecodeState | None, *, images=None,
             embedded=None, return_hidden=False, last_only=False):
        """The forward over tokens [B, T]: (logits [B, T, V] or, with return_hidden, the head's
        input [B, T, D]; router stats; the continued state, None without one). last_only: the
        last position's alone, [B, V] or [B, D], the final norm and head run on it only.
        embedded: the decoder's input [B, T, D] (`embed_inputs`) in place of embedding tokens
        and images here."""
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] int, got shape {tokens.shape}")
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(
                f"segment_ids must have the shape of tokens {tokens.shape}, got "
                f"{segment_ids.shape}"
            )
        period = cfg.seal_period
        remat = REMAT[cfg.remat]
        if embedded is None:
            embedded = self.embed_inputs(tokens, images)
        elif embedded.shape[:2] != tokens.shape:
            raise ValueError(f"embedded must be [B, T, D] for tokens {tokens.shape}, got shape "
                             f"{embedded.shape}")
        stream = ResidualStream.start(embedded)
        page_table = None if state is None else (state.block_tables, state.lengths)
        all_stats, all_caches = [], []
        for index, (plan, group) in enumerate(zip(self.plan, self.groups)):
            caches = None if state is None else state.caches[index]
            stream, stats, caches = _apply_group(
                group, plan, stream, period, segment_ids, caches, page_table, remat
            )
            all_stats.extend(s for s in stats if s is not None)
            all_caches.append(caches)
        if self.final_read is not None:
            with profile_scope("attn_res"):
                stream = dataclasses.replace(stream, live=self.final_read(stream))
        with profile_scope("lm_head"):
            live = stream.live[:, -1] if last_only else stream.live  # [B, D] or [B, T, D]
            hidden = self.final_norm(live)
            outputs = hidden if return_hidden else self.lm_head(hidden)
        new_state = None
        if state is not None:
            new_state = DecodeState(
                tuple(all_caches), state.block_tables, state.lengths + tokens.shape[1]
            )
        return outputs, tuple(all_stats), new_state

    def moe_sites(self) -> list[tuple[StableLatentMoE, bool]]:
        """Every MoE module with whether it is stacked, in the order `forward` returns stats."""
        return [
            (layer.ffn, plan.repeats > 1)
            for plan, group in zip(self.plan, self.groups)
            for layer in group.layers
            if layer.ffn_kind == "moe"
        ]


def _rematted(layer: DecoderLayer, remat, period, segment_ids, page_table):
    """`(stream, index, cache) -> layer(...)`, recomputed in the backward pass as the checkpoint
    policy `remat` says (None: no recomputation). One layer per checkpoint, scanned or not: with a
    whole scanned group under one checkpoint, its backward would rematerialise all the group's
    layers at once, and hold all their recomputed activations together."""
    graphdef, state = nnx.split(layer)

    def call(state, stream, index, cache):
        stream = dataclasses.replace(stream, live=checkpoint_name(stream.live, LAYER_INPUT_NAME))
        return nnx.merge(graphdef, state)(stream, index, period, segment_ids, cache, page_table)

    def apply(stream, index, cache):
        if remat is None:
            return call(state, stream, index, cache)
        static = (2,) if isinstance(index, int) else ()  # a static index seals at trace time
        return jax.checkpoint(call, policy=remat, static_argnums=static)(
            state, stream, index, cache
        )

    return apply


def _apply_group(group, plan, stream, period, segment_ids, caches, page_table, remat):
    """Runs one layer group (a Python call) or a stack of them (`lax.scan`), each layer under
    `remat`."""
    if plan.repeats == 1:
        return group(stream, plan.first, period, segment_ids, caches, page_table, remat)
    graphdef, state = nnx.split(group)
    # The scan carries the snapshots as a fixed buffer, sized for the seals made by its end.
    sealed_by_end = num_seal_slots(2 * (plan.first + plan.num_layers), period)

    def body(carry, xs):
        stream, first = carry
        state, caches = xs
        stream, stats, caches = nnx.merge(graphdef, state)(
            stream, first, period, segment_ids, caches, page_table, remat
        )
        return (stream, first + plan.size), (stats, caches)

    (stream, _), (stats, caches) = jax.lax.scan(
        body, (stream.stacked(sealed_by_end), jnp.int32(plan.first)), (state, caches)
    )
    return stream.unstacked(sealed_by_end), stats, caches


def aux_loss(router_stats: Sequence[RouterStats]) -> jax.Array:
    """Sum of the MoE auxiliary losses (zero unless `moe.balancing == "aux_loss"`)."""
    return sum((jnp.sum(s.aux_loss) for s in router_stats), jnp.zeros((), jnp.float32))

