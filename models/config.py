"""Model configuration: a frozen dataclass, presets from `tiny` to `k3`, analytic parameter counts.

    cfg = preset("k3")                 # the released 2.8T-total / 104B-active configuration
    count_params(cfg)                  # {"total": ..., "active": ..., "embedding": ..., parts}
    preset("tiny", scan_layers=True)   # any field can be overridden
    released_k3_json()                 # the released config.json, shipped as models/configs/k3.json

`ModelConfig` nests the layer configs (`KDAConfig`, `MLAConfig`, `MoEConfig`; `VisionConfig` for
a vision tower, None for a text-only model) rather than copying their fields. Layer indices in
`kda_layers` / `full_attn_layers` are 1-based, as in the released config; everything else in the
code base counts layers from 0.
"""

import dataclasses
import importlib.resources
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp

from kda.layer import KDAConfig, count_kda_params
from models.attention import MLAConfig, count_mla_params, is_positive_int
from models.attn_res import ResidualMode, seal_period
from models.vision import K3_IMAGE_TOKEN_ID, VisionConfig, count_vision_params
from moe.config import MoEConfig, count_moe_params

# How much of each layer a backward pass recomputes instead of storing (`jax.checkpoint`):
#   none: store everything; full: store only layer inputs; dots: store matmul outputs;
#   dots_no_batch: store matmul outputs without batch dimensions (weights-only products);
#   dots_kernels: store matmul outputs and the GPU kernels' outputs;
#   offload: as full, but each layer's input waits for the backward pass in pinned host memory
#     instead of on the device (`models.lm.REMAT`).
RematPolicy = Literal["none", "full", "dots", "dots_no_batch", "dots_kernels", "offload"]
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "dots_kernels", "offload")
RESIDUAL_MODES = ("block_attn_res", "full_attn_res", "plain")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The hybrid decoder: KDA and Gated MLA token mixers, dense then MoE FFNs, AttnRes.

    Attributes:
      vocab_size: tokens in the (untied) input embedding and LM head.
      d_model: residual width.
      num_layers: transformer layers (each = token mixer + FFN).
      kda_layers: 1-based indices of the KDA layers.
      full_attn_layers: 1-based indices of the Gated MLA layers (with kda_layers: every layer once).
      kda, mla, moe: the layer configs.
      first_k_dense: the first k layers use a dense SiTU-GLU FFN instead of MoE.
      dense_hidden: hidden width of those dense FFNs (activation: `moe.activation`).
      residual: "block_attn_res" (K3), "full_attn_res" or "plain" (see `models.attn_res`).
      attn_res_block_size: transformer layers per Block AttnRes block.
      norm_eps: epsilon of every RMSNorm (layer norms, final norm, AttnRes keys).
      dtype: compute dtype (activations, matmul inputs); logits and routing stay float32.
      param_dtype: dtype parameters are stored in.
      scan_layers: run repeated layer groups with `lax.scan`: faster compiles of deep models,
        slower steps (what each scanned layer saves for the backward is copied into and out of
        the loop's stacked buffers; `benchmarks/train_h200.md` has the `1b` step both ways).
      remat: recomputation policy of each layer in the backward pass (scanned layers too).
      vision: the vision tower and projector (`models.vision`), or None for a text-only model;
        `scan_layers` and `remat` apply to its blocks too.
    """

    vocab_size: int
    d_model: int
    num_layers: int
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    first_k_dense: int = 1
    dense_hidden: int = 0
    residual: ResidualMode = "block_attn_res"
    attn_res_block_size: int = 12
    norm_eps: float = 1e-5
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat: RematPolicy = "none"
    vision: VisionConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "kda_layers", tuple(self.kda_layers))
        object.__setattr__(self, "full_attn_layers", tuple(self.full_attn_layers))
        for name in ("vocab_size", "d_model", "num_layers", "attn_res_block_size"):
            _require(is_positive_int(getattr(self, name)), name, getattr(self, name),
                     "a positive int")
        for name in ("kda_layers", "full_attn_layers"):
            indices = getattr(self, name)
            outside = [i for i in indices if not 1 <= i <= self.num_layers]
            _require(not outside, name, indices,
                     f"1-based layer indices in 1..num_layers={self.num_layers}; "
                     f"{outside} are out of range")
            _require(len(set(indices)) == len(indices), name, indices, "no repeated index")
        both = set(self.kda_layers) & set(self.full_attn_layers)
        _require(not both, "full_attn_layers", self.full_attn_layers,
                 f"no layer that is also in kda_layers ({sorted(both)} are in both)")
        missing = set(range(1, self.num_layers + 1)) - set(self.kda_layers + self.full_attn_layers)
        _require(not missing, "kda_layers", self.kda_layers,
                 f"every layer in kda_layers or full_attn_layers; {sorted(missing)} are in neither")
        _require(isinstance(self.first_k_dense, int) and 0 <= self.first_k_dense <= self.num_layers,
                 "first_k_dense", self.first_k_dense, f"an int in 0..num_layers={self.num_layers}")
        _require(self.first_k_dense == 0 or is_positive_int(self.dense_hidden), "dense_hidden",
                 self.dense_hidden, "a positive int when first_k_dense > 0")
        _require(self.residual in RESIDUAL_MODES, "residual", self.residual,
                 f"one of {RESIDUAL_MODES}")
        _require(self.norm_eps > 0, "norm_eps", self.norm_eps, "a positive number")
        for name in ("dtype", "param_dtype"):
            _require(_is_float_dtype(getattr(self, name)), name, getattr(self, name),
                     "a floating dtype name such as 'bfloat16' or 'float32'")
        _require(self.remat in REMAT_POLICIES, "remat", self.remat, f"one of {REMAT_POLICIES}")
        _require(self.vision is None or isinstance(self.vision, VisionConfig), "vision",
                 self.vision, "None or a models.vision.VisionConfig")
        if self.vision is not None:
            token = self.vision.image_token_id
            _require(token is not None and 0 <= token < self.vocab_size, "vision.image_token_id",
                     token, f"a token id in 0..vocab_size-1={self.vocab_size - 1}, the "
                     "placeholder that image features replace")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def mixer_kinds(self) -> tuple[str, ...]:
        """Token mixer of each layer, 0-based: "kda" or "mla"."""
        full = set(self.full_attn_layers)
        return tuple("mla" if i + 1 in full else "kda" for i in range(self.num_layers))

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        """FFN of each layer, 0-based: "dense" or "moe"."""
        return tuple("dense" if i < self.first_k_dense else "moe" for i in range(self.num_layers))

    @property
    def seal_period(self) -> int | None:
        """Sub-layers between AttnRes seals (None for plain residuals)."""
        return seal_period(self.residual, self.attn_res_block_size)

    @classmethod
    def from_hf_config(cls, text_config: Mapping[str, Any],
                       vision_config: Mapping[str, Any] | None = None,
                       **overrides: Any) -> "ModelConfig":
        """The configuration of a released Kimi Linear / K3 `text_config` (and `vision_config`,
        `VisionConfig.from_hf_config`; None: text only), plus overrides.

        Nested configs can be overridden whole (`moe=...`); top-level fields by name.
        """
        linear = text_config["linear_attn_config"]
        lower_bound = linear.get("gate_lower_bound")
        fields = dict(
            vocab_size=text_config["vocab_size"],
            d_model=text_config["hidden_size"],
            num_layers=text_config["num_hidden_layers"],
            kda_layers=tuple(linear["kda_layers"]),
            full_attn_layers=tuple(linear["full_attn_layers"]),
            kda=KDAConfig(
                num_heads=linear["num_heads"],
                head_dim=linear["head_dim"],
                conv_size=linear.get("short_conv_kernel_size", 4),
                gate="softplus" if lower_bound is None else "lower_bound",
                gate_lower_bound=-5.0 if lower_bound is None else lower_bound,
                full_rank_gate=linear.get("use_full_rank_gate", False),
                norm_eps=text_config.get("rms_norm_eps", 1e-5),
            ),
            mla=MLAConfig(
                num_heads=text_config["num_attention_heads"],
                q_lora_rank=text_config.get("q_lora_rank"),
                kv_lora_rank=text_config["kv_lora_rank"],
                qk_nope_head_dim=text_config["qk_nope_head_dim"],
                qk_rope_head_dim=text_config["qk_rope_head_dim"],
                v_head_dim=text_config["v_head_dim"],
                output_gate=text_config.get("mla_use_output_gate", False),
                norm_eps=text_config.get("rms_norm_eps", 1e-5),
            ),
            moe=MoEConfig.from_hf_config(text_config),
            first_k_dense=text_config.get("first_k_dense_replace", 0),
            dense_hidden=text_config["intermediate_size"],
            residual="block_attn_res" if "attn_res_block_size" in text_config else "plain",
            attn_res_block_size=text_config.get("attn_res_block_size", 12),
            norm_eps=text_config.get("rms_norm_eps", 1e-5),
            vision=None if vision_config is None else _vision_of(vision_config, text_config),
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "ModelConfig":
        """`from_hf_config` of the `text_config` and `vision_config` (when there is one) in a JSON
        file such as `models/configs/k3.json`."""
        with open(path) as f:
            config = json.load(f)
        vision_config = config.get("vision_config")
        if vision_config is not None and "media_placeholder_token_id" in config:
            vision_config = dict(vision_config, media_placeholder_token_id=config[
                "media_placeholder_token_id"])
        return cls.from_hf_config(config.get("text_config", config), vision_config, **overrides)


def _vision_of(vision_config: Mapping[str, Any], text_config: Mapping[str, Any]) -> VisionConfig:
    """`VisionConfig.from_hf_config`, its projector's output width checked against the decoder's."""
    text_width = vision_config.get("text_hidden_size", text_config["hidden_size"])
    if text_width != text_config["hidden_size"]:
        raise ValueError(f"vision_config['text_hidden_size']={text_width} is invalid: expected "
                         f"the decoder's hidden_size={text_config['hidden_size']}")
    return VisionConfig.from_hf_config(vision_config)


def released_k3_json() -> dict[str, Any]:
    """The released K3 `config.json`, packaged as `models/configs/k3.json`.

    Keys: "text_config" (what `ModelConfig.from_hf_config` and `MoEConfig.from_hf_config` read),
    "vision_config", and "reported" (the published total / active parameter counts).
    """
    text = importlib.resources.files("models").joinpath("configs", "k3.json").read_text()
    return json.loads(text)


def _require(ok: bool, field: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"ModelConfig.{field}={value!r} is invalid: expected {expected}.")


def _is_float_dtype(name: Any) -> bool:
    try:
        return jnp.issubdtype(jnp.dtype(name), jnp.floating)
    except TypeError:
        return False


def hybrid_layout(num_layers: int, full_attn_layers: tuple[int, ...]):
    """(kda_layers, full_attn_layers): every layer not listed as full attention is KDA."""
    kda = tuple(i for i in range(1, num_layers + 1) if i not in set(full_attn_layers))
    return kda, tuple(full_attn_layers)


def _every(period: int, num_layers: int, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """1-based indices period, 2*period, ... up to num_layers, plus `extra`."""
    return tuple(range(period, num_layers + 1, period)) + extra


def _tiny() -> ModelConfig:
    # CPU-sized: a training step takes seconds. float32 compute: CPUs have no fast bfloat16.
    kda, full = hybrid_layout(4, _every(4, 4))
    return ModelConfig(
        vocab_size=264,  # train.tokenizer's byte-level vocabulary
        d_model=64,
        num_layers=4,
        kda_layers=kda,
        full_attn_layers=full,
        kda=KDAConfig(num_heads=2, head_dim=32, full_rank_gate=True),
        mla=MLAConfig(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=64, latent_dim=32, shared_hidden=64,
                      latent_norm=True),
        first_k_dense=1,
        dense_hidden=128,
        attn_res_block_size=2,
        dtype="float32",
    )


def _small() -> ModelConfig:
    # About 100M parameters in all (embedding excluded), byte-level vocabulary.
    kda, full = hybrid_layout(12, _every(4, 12))
    return ModelConfig(
        vocab_size=264,
        d_model=512,
        num_layers=12,
        kda_layers=kda,
        full_attn_layers=full,
        kda=KDAConfig(num_heads=4, head_dim=128, full_rank_gate=True),
        mla=MLAConfig(num_heads=4, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=32, top_k=4, expert_hidden=256, latent_dim=256,
                      shared_hidden=512, latent_norm=True),
        first_k_dense=1,
        dense_hidden=2048,
        attn_res_block_size=4,
    )


def _one_b() -> ModelConfig:
    # About 1B parameters active per token, every matmul dimension a multiple of 128 (GPU tiles).
    kda, full = hybrid_layout(16, _every(4, 16))
    return ModelConfig(
        vocab_size=32768,
        d_model=2048,
        num_layers=16,
        kda_layers=kda,
        full_attn_layers=full,
        kda=KDAConfig(num_heads=16, head_dim=128, full_rank_gate=True),
        mla=MLAConfig(num_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=64, top_k=8, expert_hidden=1024, latent_dim=1024,
                      shared_hidden=1536, latent_norm=True),
        first_k_dense=1,
        dense_hidden=6144,
        attn_res_block_size=4,
    )


def _kimi_linear_48b() -> ModelConfig:
    # Kimi-Linear-48B-A3B as released: softplus KDA gates with low-rank projections, MLA with
    # uncompressed queries and no output gate, a plain 2304-wide SwiGLU MoE, plain residuals.
    kda, full = hybrid_layout(27, _every(4, 27, extra=(27,)))
    return ModelConfig(
        vocab_size=163840,
        d_model=2304,
        num_layers=27,
        kda_layers=kda,
        full_attn_layers=full,
        kda=KDAConfig(num_heads=32, head_dim=128, gate="softplus"),
        mla=MLAConfig(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=False),
        moe=MoEConfig(num_experts=256, top_k=8, expert_hidden=1024, shared_hidden=1024,
                      routed_scaling_factor=2.446, activation="swiglu"),
        first_k_dense=1,
        dense_hidden=9216,
        residual="plain",
    )


def _k3() -> ModelConfig:
    # Kimi K3's released text tower (models/configs/k3.json): 3 KDA : 1 Gated MLA, the 93rd
    # layer an extra MLA; one dense layer then 92 Stable LatentMoE layers; Block AttnRes of 12.
    kda, full = hybrid_layout(93, _every(4, 93, extra=(93,)))
    return ModelConfig(
        vocab_size=163840,
        d_model=7168,
        num_layers=93,
        kda_layers=kda,
        full_attn_layers=full,
        kda=KDAConfig(num_heads=96, head_dim=128, gate="lower_bound", gate_lower_bound=-5.0,
                      full_rank_gate=True),
        mla=MLAConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
        moe=MoEConfig(num_experts=896, top_k=16, expert_hidden=3072, latent_dim=3584,
                      shared_hidden=2 * 3072, latent_norm=True),
        first_k_dense=1,
        dense_hidden=33792,
        residual="block_attn_res",
        attn_res_block_size=12,
        # MoonViT-V2: 27 blocks of width 1024, 12 heads of 128, patch 14, 64 x 64 positions.
        vision=VisionConfig(image_token_id=K3_IMAGE_TOKEN_ID),
    )


PRESETS = {
    "tiny": _tiny,
    "small": _small,
    "1b": _one_b,
    "kimi_linear_48b": _kimi_linear_48b,
    "k3": _k3,
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named configuration (`PRESETS`), with top-level fields replaced by `overrides`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name](), **overrides)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts, without building the model.

    Returns a dict with
      total:     every trainable parameter of the decoder except the input embedding table;
      active:    parameters used per text token (k of the routed experts), embedding excluded;
      embedding: the input embedding table (a lookup, not compute, hence reported apart);
      vision:    the vision tower and projector (0 without one), reported apart (K3's published
                 104.2B active leaves them out), and its parts vision_tower, vision_projector;
    and the parts: kda, mla, moe, moe_active, dense_ffn, norms, attn_res, lm_head (whole-model
    sums; the router bias is balancer state, not a parameter).
    """
    d = cfg.d_model
    num_mla = len(cfg.full_attn_layers)
    num_moe = cfg.num_layers - cfg.first_k_dense
    moe = count_moe_params(d, cfg.moe)
    reads = 0 if cfg.residual == "plain" else 2 * cfg.num_layers + 1
    parts = dict(
        kda=len(cfg.kda_layers) * count_kda_params(d, cfg.kda),
        mla=num_mla * count_mla_params(d, cfg.mla),
        moe=num_moe * moe["total"],
        moe_active=num_moe * moe["active"],
        dense_ffn=cfg.first_k_dense * 3 * d * cfg.dense_hidden,
        norms=(2 * cfg.num_layers + 1) * d,  # pre-mixer and pre-FFN of each layer, final norm
        attn_res=reads * 2 * d,  # a gain and a pseudo-query per read
        lm_head=d * cfg.vocab_size,
    )
    shared = (
        parts["kda"] + parts["mla"] + parts["dense_ffn"] + parts["norms"] + parts["attn_res"]
        + parts["lm_head"]
    )
    vision = (dict(tower=0, projector=0) if cfg.vision is None
              else count_vision_params(cfg.vision, d))
    return dict(
        total=shared + parts["moe"],
        active=shared + parts["moe_active"],
        embedding=d * cfg.vocab_size,
        vision=vision["tower"] + vision["projector"],
        vision_tower=vision["tower"],
        vision_projector=vision["projector"],
        **parts,
    )


def format_count(n: int) -> str:
    """1234567 -> '1.23M' (K, M, B, T)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{3 if unit in 'TB' else 2}f}{unit}"
    return str(n)
