"""The K3-class hybrid model: configs and presets, Gated MLA, Attention Residuals, the decoder,
sharding rules, memory planning and generation.

    from models.config import preset, count_params
    from models.lm import HybridLM

    cfg = preset("tiny")                        # tiny, small, 1b, kimi_linear_48b, k3
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    logits = model(tokens, segment_ids)         # [B, T, vocab] float32

Modules: `models.config` (ModelConfig, presets, count_params), `models.attention` (GatedMLA),
`models.paged_cache` (paged latent cache and its allocator), `models.attn_res` (Block/Full
AttnRes), `models.lm` (HybridLM, DecodeState), `models.generate`
(generate, Sampling), `models.vision` (the vision tower, merger, projector and the packed
vision buffer), `core.sharding` (logical axis rules, meshes, placement), `models.memory`
(per-device memory plans: `python -m models.memory --preset k3 --mesh fsdp=64,expert=16`).
"""
