"""Configuration of one MoE layer and its load balancer, and its analytic parameter counts.

`MoEConfig` holds every knob of the Stable LatentMoE layer (`moe.experts.StableLatentMoE`) and of
the router-bias balancer (`moe.routing.updated_bias`). It is frozen and validated on creation, so a
bad value fails where it is written, with the field's name in the message.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

ACTIVATIONS = ("situ", "swiglu", "clamped_swiglu")
BALANCERS = ("qb", "sign", "aux_loss", "none")
QB_ESTIMATORS = ("exact", "histogram", "minibatch_mean")
GMM_BACKENDS = ("auto", "xla", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Every knob of the MoE layer and of its balancer.

    Routing: sigmoid scores `s = sigmoid(x @ W_r)`; experts = top-k of `s + b` (b: the router bias,
    changed only by the balancer); mixture weights = the selected unbiased `s`, renormalised, times
    `routed_scaling_factor`.

    Attributes:
        num_experts: routed experts E.
        top_k: experts per token k (1 <= k <= E; quantile balancing needs k < E).
        expert_hidden: hidden width m of one routed expert (latent_dim -> m -> latent_dim).
        latent_dim: latent width l of the routed path (None = a plain MoE whose experts read and
            write the full model width).
        shared_hidden: hidden width of the one full-width shared expert (0 = no shared expert).
            Several shared experts of width h equal one of width n*h (the activation is
            elementwise), so K3's two 3072-wide shared experts are `shared_hidden=6144`.
        routed_scaling_factor: multiplies the renormalised mixture weights.
        latent_norm: RMSNorm (learnable gain) on the aggregated routed output in latent space.
            Needs `latent_dim`.
        norm_eps: epsilon of that RMSNorm.
        activation: "situ" (SiTU-GLU), "swiglu", or "clamped_swiglu" (ablations).
        situ_beta: softcap of the SiTU gate branch (the gate is bounded by this).
        situ_linear_beta: softcap of the SiTU up branch.
        swiglu_limit: clamp of "clamped_swiglu" (gate <= limit, |up| <= limit).
        balancing: "qb" (Quantile Balancing), "sign" (DeepSeek-V3's sign rule), "aux_loss"
            (Switch-style auxiliary loss), or "none".
        sign_rate: step gamma of the sign rule.
        aux_loss_weight: weight of the auxiliary loss (used when balancing == "aux_loss").
        dynamic_k: expert j fires for token i iff `s_ij > beta_j` (a variable number of experts
            per token) instead of top-k; `beta = -b`. With "qb", beta is an EMA of the
            (1 - k/E) quantile of the scores.
        dynamic_k_max: most experts one token may fire under dynamic_k (None = min(2k, E)); the
            fixed slot count keeps the dispatch shapes static.
        dynamic_k_decay: EMA decay lambda of the dynamic-k threshold.
        capacity_factor: expert-parallel buffer size per destination shard, as a multiple of the
            even share `tokens * k / shards` (None = dropless: buffers big enough that no token
            copy is ever dropped).
        qb_estimator: how the per-expert quantile is computed over the batch: "exact", a
            "histogram" of margins (bin counts add over shards and micro-batches), or
            "minibatch_mean" (exact quantile per mini-batch, averaged).
        qb_bins: number of histogram bins.
        qb_minibatches: number of mini-batches of "minibatch_mean".
        gmm_backend: grouped matmul: "auto" (Mosaic GPU kernel on Hopper, else XLA), "xla"
            (`jax.lax.ragged_dot`), or "mosaic_gpu".
        fuse_glu_epilogues: compute the routed experts' activation in the grouped matmuls'
            epilogues (`moe.dispatch.fused_expert_mlp`) where the Mosaic GPU kernels run;
            elsewhere it has no effect. False by default: the fused path is slower than the
            unfused one (`benchmarks/expert_mlp_h200.md`).
        token_chunk: positions per chunk along T for the layer's per-token part (None = all
            tokens at once). The router, the routing and the `RouterStats` always cover all
            B·T tokens; the down-projection, dispatch, expert MLPs, latent norm, up-projection
            and shared expert then run on [B, token_chunk] tokens at a time, each chunk under
            `jax.checkpoint`, so a backward pass holds one chunk's dispatch buffers. Equal to the
            unchunked layer up to float rounding (`docs/latent_moe.md`), except that under
            expert parallelism with a `capacity_factor` the buffers are sized per chunk.
    """

    num_experts: int = 64
    top_k: int = 8
    expert_hidden: int = 1024
    latent_dim: int | None = None
    shared_hidden: int = 0
    routed_scaling_factor: float = 1.0
    latent_norm: bool = False
    norm_eps: float = 1e-5
    activation: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    swiglu_limit: float = 7.0
    balancing: str = "qb"
    sign_rate: float = 1e-3
    aux_loss_weight: float = 1e-2
    dynamic_k: bool = False
    dynamic_k_max: int | None = None
    dynamic_k_decay: float = 0.9
    capacity_factor: float | None = None
    qb_estimator: str = "exact"
    qb_bins: int = 1024
    qb_minibatches: int = 1
    gmm_backend: str = "auto"
    fuse_glu_epilogues: bool = False
    token_chunk: int | None = None

    def __post_init__(self):
        _require(self.num_experts >= 1, "num_experts", self.num_experts, "an integer >= 1")
        _require(
            1 <= self.top_k <= self.num_experts,
            "top_k",
            self.top_k,
            f"1 <= top_k <= num_experts ({self.num_experts})",
        )
        _require(self.expert_hidden >= 1, "expert_hidden", self.expert_hidden, "an integer >= 1")
        _require(
            self.latent_dim is None or self.latent_dim >= 1,
            "latent_dim",
            self.latent_dim,
            "None (plain MoE) or an integer >= 1",
        )
        _require(self.shared_hidden >= 0, "shared_hidden", self.shared_hidden, "an integer >= 0")
        _require(
            self.routed_scaling_factor > 0,
            "routed_scaling_factor",
            self.routed_scaling_factor,
            "a positive number",
        )
        _require(
            not self.latent_norm or self.latent_dim is not None,
            "latent_norm",
            self.latent_norm,
            "False when latent_dim is None (the norm lives in the latent space); set latent_dim",
        )
        _require(self.norm_eps > 0, "norm_eps", self.norm_eps, "a positive number")
        _require(
            self.activation in ACTIVATIONS, "activation", self.activation, f"one of {ACTIVATIONS}"
        )
        for name in ("situ_beta", "situ_linear_beta", "swiglu_limit"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "a positive number")
        _require(self.balancing in BALANCERS, "balancing", self.balancing, f"one of {BALANCERS}")
        _require(self.sign_rate > 0, "sign_rate", self.sign_rate, "a positive number")
        _require(
            self.aux_loss_weight >= 0, "aux_loss_weight", self.aux_loss_weight, "a number >= 0"
        )
        _require(
            self.balancing != "qb" or self.top_k < self.num_experts,
            "top_k",
            self.top_k,
            "top_k < num_experts for quantile balancing (with k == E every expert is always "
            "chosen, so there is nothing to balance); use balancing='none'",
        )
        _require(
            self.dynamic_k_max is None or self.top_k <= self.dynamic_k_max <= self.num_experts,
            "dynamic_k_max",
            self.dynamic_k_max,
            f"None or top_k ({self.top_k}) <= dynamic_k_max <= num_experts ({self.num_experts})",
        )
        _require(
            0 <= self.dynamic_k_decay < 1, "dynamic_k_decay", self.dynamic_k_decay, "in [0, 1)"
        )
        _require(
            self.capacity_factor is None or self.capacity_factor > 0,
            "capacity_factor",
            self.capacity_factor,
            "None (dropless) or a positive number",
        )
        _require(
            self.qb_estimator in QB_ESTIMATORS,
            "qb_estimator",
            self.qb_estimator,
            f"one of {QB_ESTIMATORS}",
        )
        _require(self.qb_bins >= 2, "qb_bins", self.qb_bins, "an integer >= 2")
        _require(self.qb_minibatches >= 1, "qb_minibatches", self.qb_minibatches, "an integer >= 1")
        _require(
            self.gmm_backend in GMM_BACKENDS,
            "gmm_backend",
            self.gmm_backend,
            f"one of {GMM_BACKENDS}",
        )
        _require(
            isinstance(self.fuse_glu_epilogues, bool),
            "fuse_glu_epilogues",
            self.fuse_glu_epilogues,
            "True or False",
        )
        _require(
            self.token_chunk is None
            or (isinstance(self.token_chunk, int) and not isinstance(self.token_chunk, bool)
                and self.token_chunk >= 1),
            "token_chunk",
            self.token_chunk,
            "None (all tokens at once) or an integer >= 1 (positions per chunk along T)",
        )

    def routed_width(self, d_model: int) -> int:
        """Width the routed experts read and write: latent_dim, or d_model for a plain MoE."""
        return d_model if self.latent_dim is None else self.latent_dim

    @property
    def slots_per_token(self) -> int:
        """Expert slots per token: k, or dynamic_k_max (default min(2k, E)) under dynamic_k."""
        if not self.dynamic_k:
            return self.top_k
        if self.dynamic_k_max is not None:
            return self.dynamic_k_max
        return min(2 * self.top_k, self.num_experts)

    @classmethod
    def from_hf_config(cls, text_config: Mapping[str, Any], **overrides: Any) -> MoEConfig:
        """The MoE settings of a Kimi-style `text_config` (as in `models/configs/k3.json`), plus
        overrides."""
        activation = text_config.get("hidden_act", "situ")
        fields = dict(
            num_experts=text_config["num_experts"],
            top_k=text_config["num_experts_per_token"],
            expert_hidden=text_config["moe_intermediate_size"],
            latent_dim=text_config.get("routed_expert_hidden_size"),
            shared_hidden=text_config.get("num_shared_experts", 0)
            * text_config["moe_intermediate_size"],
            routed_scaling_factor=text_config.get("routed_scaling_factor", 1.0),
            latent_norm=text_config.get("latent_moe_use_norm", False),
            norm_eps=text_config.get("rms_norm_eps", 1e-5),
            activation="swiglu" if activation == "silu" else activation,
            situ_beta=text_config.get("activation_situ_beta", 4.0),
            situ_linear_beta=text_config.get("activation_situ_linear_beta", 25.0),
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_json(cls, path: str, **overrides: Any) -> MoEConfig:
        """`from_hf_config` of the `text_config` in a JSON file such as `models/configs/k3.json`."""
        with open(path) as f:
            config = json.load(f)
        return cls.from_hf_config(config.get("text_config", config), **overrides)


def count_moe_params(d_model: int, cfg: MoEConfig) -> dict[str, int]:
    """Analytic trainable-parameter counts of one `StableLatentMoE` layer.

    The router bias is a balancer state, not a trainable parameter, and is not counted. Under
    dynamic_k the active count uses the average k, which is what the balancer targets.

    Returns:
        dict with `total` and `active` (per token) and their parts: `routed_experts` (all E),
        `active_routed_experts` (k of them), `shared_experts`, `latent_proj` (down + up),
        `latent_norm`, `router`.
    """
    if d_model < 1:
        raise ValueError(f"d_model must be an integer >= 1, got {d_model!r}")
    width = cfg.routed_width(d_model)
    one_expert = 3 * width * cfg.expert_hidden
    parts = dict(
        routed_experts=cfg.num_experts * one_expert,
        active_routed_experts=cfg.top_k * one_expert,
        shared_experts=3 * d_model * cfg.shared_hidden,
        latent_proj=0 if cfg.latent_dim is None else 2 * d_model * cfg.latent_dim,
        latent_norm=cfg.latent_dim if cfg.latent_norm else 0,
        router=d_model * cfg.num_experts,
    )
    common = parts["shared_experts"] + parts["latent_proj"] + parts["latent_norm"] + parts["router"]
    return dict(
        total=parts["routed_experts"] + common,
        active=parts["active_routed_experts"] + common,
        **parts,
    )


def active_matmul_flops(d_model: int, cfg: MoEConfig) -> int:
    """Forward matmul FLOPs per token of one MoE layer (2 per multiply-add of active weights)."""
    counts = count_moe_params(d_model, cfg)
    return 2 * (counts["active"] - counts["latent_norm"])


def _require(ok: bool, field: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"MoEConfig.{field}={value!r} is invalid: expected {expected}.")

