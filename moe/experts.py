"""Flax NNX modules: the Stable LatentMoE layer, the dense GLU FFN, and the router-bias update.

Stable LatentMoE (Kimi K3 report Eq. 11-13; derivation in `docs/latent_moe.md`):

    s, (ids, p) = sigmoid(W_r x), top-k of s + b        router on the full-width x
    u = sum_{j in ids} p_j · E_j(W_down x)              routed experts in latent width l
    y = W_up · RMSNorm_l(u) + Shared(x)                 one norm on the aggregated u

x, y: [B, T, D]; the router runs in float32, experts and projections in `dtype` (bf16 by
default) with float32 parameters. Experts and the shared expert are GLU MLPs with the configured
activation (SiTU-GLU by default). With `latent_dim=None` it is a plain MoE (experts read x
directly, no W_down / W_up / norm). With `MoEConfig.token_chunk`, everything after the routing
runs on [B, token_chunk] tokens at a time, each chunk recomputed in the backward pass, while the
routing and its statistics still cover all tokens (`docs/latent_moe.md`, "Token chunks").

The balancer (`update_router_biases`) runs after the optimizer step on the `RouterStats` each
layer returns, outside the gradient: it writes the `RouterBias` variables in place.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core.chunks import map_chunks, merge_chunks, split_chunks
from core.norms import rms_norm
from core.sharding import logical
from moe.activations import GLUActivation, fused_glu
from moe.config import MoEConfig
from moe.dispatch import EXPERT_AXIS, data_parallel_moe, dropless_moe, expert_parallel_moe
from moe.routing import (
    PERMUTATION_NAME,
    RouterStats,
    dynamic_route,
    initial_dynamic_bias,
    load_counts,
    route,
    router_scores,
    switch_aux_loss,
    updated_bias,
)

# The `checkpoint_name` of the expert weights cast to the compute dtype, which `models.lm`'s
# `dots_kernels` remat policy keeps: recasting them for the backward pass would re-read every
# float32 expert weight. (`train.step` goes further: its state keeps the bf16 copies, so the
# training forward casts nothing.)
EXPERT_WEIGHTS_NAME = "moe_expert_weights"


class RouterBias(nnx.Variable):
    """Per-expert router bias b [E]: changes which experts are chosen, never the weights.

    Not an `nnx.Param`, so optimizers built with `wrt=nnx.Param` and `nnx.grad` leave it alone;
    only the balancer (`update_router_biases`) writes it. Under dynamic_k it is minus the
    per-expert firing threshold.
    """


def _fan_in_normal(fan_in: int, axes: tuple[str | None, ...]):
    """Normal(0, 1/fan_in) initializer with logical axis names (variance-preserving)."""
    return logical(nnx.initializers.normal(stddev=fan_in**-0.5), axes)


class DenseFFN(nnx.Module):
    """Dense GLU FFN `W_out · act(W_gate x, W_up x)` (the first `first_k_dense` layers' FFN and
    the shared expert).

    Parameters: w_in [D, 2, H] (gate, up) with axes ("embed", None, "mlp"); w_out [H, D] with
    axes ("mlp", "embed").
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: str = "situ",
        *,
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
        swiglu_limit: float = 7.0,
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if d_model < 1 or hidden < 1:
            raise ValueError(f"d_model and hidden must be >= 1, got {d_model} and {hidden}.")
        self.activation = GLUActivation(activation, situ_beta, situ_linear_beta, swiglu_limit)
        self.dtype = dtype
        self.w_in = nnx.Param(
            _fan_in_normal(d_model, ("embed", None, "mlp"))(
                rngs.params(), (d_model, 2, hidden), param_dtype
            )
        )
        self.w_out = nnx.Param(
            _fan_in_normal(hidden, ("mlp", "embed"))(rngs.params(), (hidden, d_model), param_dtype)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in self.dtype."""
        if x.shape[-1] != self.w_in.shape[0]:
            raise ValueError(f"x must be [..., D={self.w_in.shape[0]}], got shape {x.shape}.")
        w_in = self.w_in[...].astype(self.dtype)
        gate_up = jnp.einsum("...d,dch->...ch", x.astype(self.dtype), w_in)
        hidden = fused_glu(self.activation, gate_up)
        return hidden @ self.w_out[...].astype(self.dtype)


class StableLatentMoE(nnx.Module):
    """Sigmoid-routed MoE with latent experts, latent RMSNorm and a full-width shared expert.

    Parameters (logical axes): router [D, E] ("embed", None), float32 compute; router_bias [E]
    (`RouterBias`, ("expert",)); w_down [D, l] ("embed", "latent"); latent_gain [l] ("latent",);
    w_up [l, D] ("latent", "embed"); expert_w_in [E, l, 2, M] ("expert", "latent", None, "mlp");
    expert_w_out [E, M, l] ("expert", "mlp", "latent"); shared: `DenseFFN`. In a plain MoE the
    expert width axis is "embed".

    Under a mesh with an `expert` axis of size > 1 (`jax.set_mesh`), the routed experts run expert
    parallel (`moe.dispatch.expert_parallel_moe`; with `token_chunk`, chunk by chunk, each chunk's
    B·token_chunk tokens split over all devices); under a mesh of several devices without one,
    dropless on each device's own tokens (`moe.dispatch.data_parallel_moe`).
    """

    def __init__(
        self,
        d_model: int,
        cfg: MoEConfig,
        *,
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}.")
        self.cfg = cfg
        self.d_model = d_model
        self.dtype = dtype
        self.activation = GLUActivation.from_config(cfg)
        num_experts, hidden = cfg.num_experts, cfg.expert_hidden
        width = cfg.routed_width(d_model)
        width_axis = "embed" if cfg.latent_dim is None else "latent"

        self.router = nnx.Param(
            _fan_in_normal(d_model, ("embed", None))(
                rngs.params(), (d_model, num_experts), param_dtype
            )
        )
        initial_bias = (
            initial_dynamic_bias(num_experts, cfg.top_k)
            if cfg.dynamic_k
            else jnp.zeros((num_experts,), jnp.float32)
        )
        self.router_bias = RouterBias(initial_bias, out_sharding=("expert",), eager_sharding=False)
        if cfg.latent_dim is not None:
            self.w_down = nnx.Param(
                _fan_in_normal(d_model, ("embed", "latent"))(
                    rngs.params(), (d_model, width), param_dtype
                )
            )
            self.w_up = nnx.Param(
                _fan_in_normal(width, ("latent", "embed"))(
                    rngs.params(), (width, d_model), param_dtype
                )
            )
        if cfg.latent_norm:
            self.latent_gain = nnx.Param(
                logical(nnx.initializers.ones_init(), ("latent",))(
                    rngs.params(), (width,), param_dtype
                )
            )
        self.expert_w_in = nnx.Param(
            _fan_in_normal(width, ("expert", width_axis, None, "mlp"))(
                rngs.params(), (num_experts, width, 2, hidden), param_dtype
            )
        )
        self.expert_w_out = nnx.Param(
            _fan_in_normal(hidden, ("expert", "mlp", width_axis))(
                rngs.params(), (num_experts, hidden, width), param_dtype
            )
        )
        self.shared = (
            DenseFFN(
                d_model,
                cfg.shared_hidden,
                cfg.activation,
                situ_beta=cfg.situ_beta,
                situ_linear_beta=cfg.situ_linear_beta,
                swiglu_limit=cfg.swiglu_limit,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )
            if cfg.shared_hidden
            else None
        )

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, RouterStats]:
        """Mix each token's routed experts and add the shared expert.

        Args:
            x: [B, T, D] layer input (the router reads it at full width, in float32).
            segment_ids: [B, T] int packing ids; 0 marks padding, which gets no routed output
                and is left out of the balancer statistics and the auxiliary loss.

        Returns:
            y: [B, T, D] in self.dtype.
            stats: `RouterStats` for `update_router_biases` and `moe.routing.balance_metrics`.
        """
        cfg = self.cfg
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [B, T, D={self.d_model}], got shape {x.shape}.")
        if segment_ids is not None and segment_ids.shape != x.shape[:2]:
            raise ValueError(
                f"segment_ids must be [B, T] = {x.shape[:2]}, got {segment_ids.shape}."
            )
        batch, length, _ = x.shape
        tokens = x.reshape(batch * length, self.d_model)
        token_mask = (
            jnp.ones((tokens.shape[0],), bool)
            if segment_ids is None
            else segment_ids.reshape(-1) != 0
        )

        scores = router_scores(tokens, self.router[...])
        bias = self.router_bias[...]
        if cfg.dynamic_k:
            expert_ids, weights, fired = dynamic_route(
                scores, bias, cfg.slots_per_token, cfg.routed_scaling_factor
            )
        else:
            expert_ids, weights = route(scores, bias, cfg.top_k, cfg.routed_scaling_factor)
            fired = jnp.ones(expert_ids.shape, bool)
        copy_mask = fired & token_mask[:, None]
        expert_ids, weights, copy_mask = (
            checkpoint_name(a, PERMUTATION_NAME)
            for a in (expert_ids, jnp.where(copy_mask, weights, 0.0), copy_mask))

        w_in, w_out = (checkpoint_name(weight[...].astype(self.dtype), EXPERT_WEIGHTS_NAME)
                       for weight in self.kernel_weights().values())
        if cfg.token_chunk is None:
            y, dropped = self._per_token(tokens, expert_ids, weights, copy_mask, w_in, w_out)
        else:
            y, dropped = self._per_token_in_chunks(
                x, *(a.reshape(batch, length, -1) for a in (expert_ids, weights, copy_mask)),
                w_in, w_out,
            )

        aux_loss = (
            cfg.aux_loss_weight * switch_aux_loss(scores, expert_ids, copy_mask)
            if cfg.balancing == "aux_loss"
            else jnp.zeros((), jnp.float32)
        )
        stats = RouterStats(
            scores=jax.lax.stop_gradient(scores).reshape(batch, length, -1),
            expert_ids=expert_ids.reshape(batch, length, -1),
            copy_mask=copy_mask.reshape(batch, length, -1),
            token_mask=token_mask.reshape(batch, length),
            load=load_counts(expert_ids, cfg.num_experts, copy_mask),
            aux_loss=aux_loss,
            dropped=dropped,
        )
        return y.reshape(batch, length, self.d_model).astype(self.dtype), stats

    def _per_token(self, tokens, expert_ids, weights, copy_mask, w_in, w_out):
        """Everything of the layer after the routing, on n tokens routed already.

        Args:
            tokens: [n, D] layer input.
            expert_ids: [n, S] int32, weights: [n, S] float32 (0 where the copy is masked),
                copy_mask: [n, S] bool: the routing (`route` or `dynamic_route`).
            w_in: [E, W, 2, M], w_out: [E, M, W] expert weights in self.dtype.

        Returns:
            y: [n, D] in self.dtype, `W_up RMSNorm(sum_j p_j E_j(W_down x)) + Shared(x)`.
            dropped: [] float32 token copies dropped by expert parallelism.
        """
        cfg = self.cfg
        routed_in = tokens.astype(self.dtype)
        if cfg.latent_dim is not None:
            routed_in = routed_in @ self.w_down[...].astype(self.dtype)
        routed, dropped = self._routed_experts(
            routed_in, expert_ids, weights, copy_mask, w_in, w_out
        )
        routed = checkpoint_name(routed, PERMUTATION_NAME)
        if cfg.latent_norm:
            routed = rms_norm(routed, self.latent_gain[...], cfg.norm_eps)
        if cfg.latent_dim is not None:
            routed = routed @ self.w_up[...].astype(self.dtype)
        y = routed if self.shared is None else routed + self.shared(tokens)
        return y, dropped

    def _per_token_in_chunks(self, x, expert_ids, weights, copy_mask, w_in, w_out):
        """`_per_token` on [B, token_chunk] tokens at a time (`MoEConfig.token_chunk`).

        Args:
            x: [B, T, D] layer input.
            expert_ids, weights, copy_mask: [B, T, S] the routing of all B·T tokens.
            w_in, w_out: expert weights in self.dtype, as `_per_token`'s.

        Returns:
            y: [B·T, D] in self.dtype; dropped: [] float32, summed over chunks.

        `core.chunks.map_chunks` over `core.chunks.split_chunks` of the inputs: the forward
        keeps the inputs and the layer's weights, and the backward rebuilds and holds one chunk's
        dispatch buffers at a time. (An enclosing checkpoint's policy sees the chunks whole: the
        names inside them are not saved.) The tail positions that
        pad T to whole chunks have x 0, copy_mask False and weight 0: they send nothing under
        expert parallelism, add 0 on one device, and are cut from the output, so they reach
        neither y nor any gradient.

        The expert weights enter the chunks in float32 and are cast back inside each: the
        backward sums their gradients chunk by chunk in that dtype, and float32 keeps the sum as
        precise as the unchunked layer's one grouped product (the round trip from self.dtype is
        exact).
        """
        batch, length, _ = x.shape
        chunk = self.cfg.token_chunk
        mesh = jax.sharding.get_abstract_mesh()
        if _expert_shards(mesh) > 1 and batch * chunk % mesh.size:
            raise ValueError(
                f"MoEConfig.token_chunk={chunk} with batch {batch} gives chunks of "
                f"{batch * chunk} tokens, which expert parallelism splits over all "
                f"{mesh.size} devices of the mesh: choose token_chunk so that "
                f"batch * token_chunk divides by {mesh.size}."
            )
        w_in, w_out = (w.astype(jnp.float32) for w in (w_in, w_out))

        graphdef, state = nnx.split(self)

        def one_chunk(params, chunk_arrays):
            state, w_in, w_out = params
            tokens, ids, chunk_weights, mask = (a.reshape(batch * chunk, -1) for a in chunk_arrays)
            y, dropped = nnx.merge(graphdef, state)._per_token(
                tokens, ids, chunk_weights, mask, w_in.astype(self.dtype),
                w_out.astype(self.dtype))
            return y.reshape(batch, chunk, -1), dropped

        chunks = [split_chunks(a, chunk) for a in (x, expert_ids, weights, copy_mask)]
        y, dropped = map_chunks(one_chunk, (state, w_in, w_out), chunks)
        return merge_chunks(y, length).reshape(batch * length, -1), jnp.sum(dropped)

    def kernel_weights(self) -> dict[str, nnx.Param]:
        """The parameters the routed experts read in `self.dtype`, by attribute name: the grouped
        GEMM kernels take them as they are, so their cast from float32 cannot fuse into them
        (`train.step.TrainState` keeps them rounded, written by the update)."""
        return {"expert_w_in": self.expert_w_in, "expert_w_out": self.expert_w_out}

    def _routed_experts(self, z, expert_ids, weights, copy_mask, w_in, w_out):
        """Routed-expert mix of z [N, W] with expert weights w_in [E, W, 2, M], w_out [E, M, W]:
        expert parallel under an `expert` mesh axis."""
        mesh = jax.sharding.get_abstract_mesh()
        if _expert_shards(mesh) > 1:
            return expert_parallel_moe(
                z,
                expert_ids,
                weights,
                w_in,
                w_out,
                self.activation,
                copy_mask=copy_mask,
                capacity_factor=self.cfg.capacity_factor,
                backend=self.cfg.gmm_backend,
                fuse_glu_epilogues=self.cfg.fuse_glu_epilogues,
                mesh=mesh,
            )
        dispatch = data_parallel_moe if _splits_tokens(mesh, z.shape[0]) else dropless_moe
        y = dispatch(
            z, expert_ids, weights, w_in, w_out, self.activation, backend=self.cfg.gmm_backend,
            fuse_glu_epilogues=self.cfg.fuse_glu_epilogues,
        )
        return y, jnp.zeros((), jnp.float32)


def _expert_shards(mesh) -> int:
    """Size of the mesh's `expert` axis (1 without one): above 1, the experts run in parallel."""
    return mesh.shape[EXPERT_AXIS] if EXPERT_AXIS in mesh.axis_names else 1


def _splits_tokens(mesh, num_tokens: int) -> bool:
    """Whether the routed experts run data parallel (`data_parallel_moe`): a mesh of several
    devices, none of its axes manual already (inside a `shard_map` the tokens are local), that
    splits num_tokens evenly. Otherwise they run as one program over all tokens (`dropless_moe`):
    the same result, every device doing the whole batch's work."""
    manual = any(kind == jax.sharding.AxisType.Manual for kind in mesh.axis_types)
    return mesh.size > 1 and not manual and num_tokens % mesh.size == 0


def moe_layers(model: nnx.Module) -> list[StableLatentMoE]:
    """The `StableLatentMoE` layers of a model, in NNX graph order: the order their stats come in
    when the model calls them in that order (`update_router_biases(moe_layers(model), stats)`)."""
    return [module for _, module in nnx.iter_modules(model) if isinstance(module, StableLatentMoE)]


def update_router_biases(
    layers: Sequence[StableLatentMoE], stats: Sequence[RouterStats]
) -> None:
    """Apply the balancer (`moe.routing.updated_bias`) to every MoE layer, in place.

    Runs after the optimizer step, outside any gradient, on the stats routed with the old bias.

    Args:
        layers: the MoE layers in the order their stats were produced (`models.lm.HybridLM.
            moe_sites`, `moe_layers`). A layer stacked by `nnx.vmap` (router bias [L, E], stats
            with a leading L axis) is updated slice by slice; a plain one has bias [E].
        stats: one `RouterStats` per layer.

    The updates run layer by layer on purpose, not as one update vmapped over every layer: the
    exact quantile's counting passes then read one layer's scores at a time, which stay in the
    L2 cache, instead of all layers' scores at once (`benchmarks/train_notes.md`).
    """
    if len(layers) != len(stats):
        raise ValueError(
            f"got {len(stats)} RouterStats for {len(layers)} MoE layers; pass one per layer, in "
            "the order the stats were produced."
        )
    for layer, layer_stats in zip(layers, stats):
        update = functools.partial(updated_bias, layer.cfg)
        if layer.router_bias[...].ndim == 2:  # [L, E]: a stack of layers
            update = jax.vmap(update)
        layer.router_bias[...] = update(layer.router_bias[...], layer_stats)
