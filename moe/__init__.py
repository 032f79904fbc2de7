"""Mixture of experts: Quantile-Balanced sigmoid routing, Stable LatentMoE with SiTU-GLU, dropless
grouped-GEMM dispatch and expert parallelism.

Layer: `StableLatentMoE(d_model, cfg, *, dtype, param_dtype, rngs)(x [B, T, D], segment_ids)`
returns `(y [B, T, D], RouterStats)`; `DenseFFN` for the first dense layers. `MoEConfig` holds
every knob; `count_moe_params` gives the analytic parameter counts.

Balancer, the single entry point the trainer calls after each optimizer step, outside the
gradient (identical on every replica; derivation in `docs/quantile_balancing.md`):

    new_bias = moe.routing.updated_bias(cfg, bias, stats)      # one layer
    moe.experts.update_router_biases(layers, stats_per_layer)  # every MoE layer, in place

The router bias is a `RouterBias` variable, not an `nnx.Param`: optimizers built with
`wrt=nnx.Param` and `nnx.grad` never touch it. Metrics: `moe.routing.balance_metrics`.

Dispatch: dropless (sort by expert, two grouped matmuls, un-sort) on each device; under a mesh with
an `expert` axis (`jax.set_mesh`) the layer runs expert parallel with fixed-capacity all-to-all
(`MoEConfig.capacity_factor`, None = never drop; dropped copies are counted in `stats.dropped`).
At long T, `MoEConfig.token_chunk` runs everything after the routing on [B, token_chunk] tokens
at a time, each chunk recomputed in the backward pass (`docs/latent_moe.md`, "Token chunks").
Grouped matmuls (`MoEConfig.gmm_backend`, `moe.grouped_matmul`) run on Hopper through our
warp-specialized Mosaic GPU kernels (`moe.kernels.mosaic_gpu`: the row-ragged products and the
weight gradient), and through `jax.lax.ragged_dot` elsewhere. Their GLU-fused epilogues
(`MoEConfig.fuse_glu_epilogues`) stay off: slower than the unfused path
(`benchmarks/expert_mlp_h200.md`).
"""

from moe.activations import GLUActivation, clamped_swiglu, situ_glu, swiglu
from moe.config import MoEConfig, active_matmul_flops, count_moe_params
from moe.dispatch import dropless_moe, expert_parallel_moe
from moe.experts import (
    DenseFFN,
    RouterBias,
    StableLatentMoE,
    moe_layers,
    update_router_biases,
)
from moe.routing import (
    RouterStats,
    balance_metrics,
    max_violation,
    quantile_balance,
    route,
    updated_bias,
)

__all__ = [
    "DenseFFN",
    "GLUActivation",
    "MoEConfig",
    "RouterBias",
    "RouterStats",
    "StableLatentMoE",
    "active_matmul_flops",
    "balance_metrics",
    "clamped_swiglu",
    "count_moe_params",
    "dropless_moe",
    "expert_parallel_moe",
    "max_violation",
    "moe_layers",
    "quantile_balance",
    "route",
    "situ_glu",
    "swiglu",
    "update_router_biases",
    "updated_bias",
]
