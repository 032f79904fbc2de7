"""QK-Clip for the Gated MLA layers (the Kimi K2 report): keep attention logits below tau.

After each optimizer step, every MLA head h whose largest pre-softmax logit S_h in the step's
forward pass exceeded tau has its query and key weights shrunk by gamma_h = tau / S_h: the
per-head query and key "nope" columns by sqrt(gamma_h) each, the per-head query "rope" columns by
gamma_h (the rope key part is shared by all heads, so it is left alone). The product of the two
scales is gamma_h, so that head's logits would have peaked at exactly tau.

The logits come from the forward pass itself: `capture_forward` records the outputs of each MLA
layer's `q_up`, `kv_up` and `kv_down` projections (flax's `nnx.capture`), and `max_logits`
recomputes the scores from them. Layers inside a `lax.scan` (`scan_layers`) are not captured, so
QK-Clip needs `scan_layers=False`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import GatedMLA, MLAConfig

Path = tuple


def mla_layers(model: nnx.Module) -> list[tuple[Path, GatedMLA]]:
    """(path, layer) of every Gated MLA layer, in graph order."""
    return [(path, module) for path, module in nnx.iter_modules(model)
            if isinstance(module, GatedMLA)]


def capture_forward(model: nnx.Module, tokens: jax.Array, segment_ids: jax.Array, **options):
    """`model.forward(tokens, segment_ids, **options)` that also returns the projections QK-Clip
    reads.

    Returns (forward's output, {MLA path: (q, kv_up output, kv_down output)}).
    Raises ValueError if an MLA layer's projections were not captured (a scanned layer).
    """
    forward = nnx.capture(lambda m, t, s: m.forward(t, s, **options), nnx.Intermediate,
                          method_outputs=nnx.Intermediate)
    output, intermediates = forward(model, tokens, segment_ids)
    recorded = dict(nnx.to_flat_state(intermediates))
    captured = {}
    for path, _ in mla_layers(model):
        try:
            captured[path] = tuple(
                recorded[path + (name, "__call__")].get_value()[0]
                for name in ("q_up", "kv_up", "kv_down")
            )
        except KeyError:
            raise ValueError(
                f"QK-Clip could not read the attention logits of the MLA layer at {path}: layers "
                "inside a scanned group are not captured; set model scan_layers=False or turn "
                "qk_clip off"
            ) from None
    return output, captured


def max_logits(
    cfg: MLAConfig,
    q: jax.Array,
    kv_up_out: jax.Array,
    kv_down_out: jax.Array,
    segment_ids: jax.Array,
) -> jax.Array:
    """Largest pre-softmax logit of each head over the causal, same-document pairs of real tokens.

    q: [B, T, H, N + R] (q_up output); kv_up_out: [B, T, H, N + V]; kv_down_out: [B, T, C + R];
    segment_ids: [B, T] (0 = padding). Returns float32 [H] (-inf for a batch without tokens).
    """
    nope = cfg.qk_nope_head_dim
    q = q.astype(jnp.float32)
    k_nope = kv_up_out[..., :nope].astype(jnp.float32)
    k_rope = kv_down_out[..., cfg.kv_lora_rank:].astype(jnp.float32)
    scores = jnp.einsum("bthn,bshn->bhts", q[..., :nope], k_nope) + jnp.einsum(
        "bthr,bsr->bhts", q[..., nope:], k_rope
    )
    length = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    visible = (
        causal[None]
        & (segment_ids[:, :, None] == segment_ids[:, None, :])
        & (segment_ids[:, :, None] > 0)
    )
    scores = jnp.where(visible[:, None], scores * cfg.softmax_scale, -jnp.inf)
    return jnp.max(scores, axis=(0, 2, 3))


def clip_query_key(layer: GatedMLA, head_max_logits: jax.Array, tau: float) -> None:
    """Shrinks, in place, the query/key weights of the heads whose max logit exceeded tau.

    head_max_logits: [H] from `max_logits`.
    """
    nope = layer.cfg.qk_nope_head_dim
    gamma = jnp.minimum(1.0, tau / jnp.maximum(head_max_logits, 1e-30))  # [H]
    root = jnp.sqrt(gamma)
    q_kernel = layer.q_up.kernel  # [Q, H, N + R]
    q_scale = jnp.concatenate(
        [jnp.broadcast_to(root[:, None], (gamma.size, nope)),
         jnp.broadcast_to(gamma[:, None], (gamma.size, q_kernel.shape[-1] - nope))],
        axis=-1,
    )
    q_kernel[...] = q_kernel[...] * q_scale.astype(q_kernel.dtype)
    kv_kernel = layer.kv_up.kernel  # [C, H, N + V]
    kv_scale = jnp.concatenate(
        [jnp.broadcast_to(root[:, None], (gamma.size, nope)),
         jnp.ones((gamma.size, kv_kernel.shape[-1] - nope), gamma.dtype)],
        axis=-1,
    )
    kv_kernel[...] = kv_kernel[...] * kv_scale.astype(kv_kernel.dtype)
