"""A small model with the trainer's interface, for fast training-step tests, and its batches.

embedding -> Gated MLA -> Stable LatentMoE -> LM head, residual; `forward(tokens, segment_ids)`
returns (logits, router stats) (with `return_hidden`, the LM head's input instead of the
logits), `lm_head` is a `models.lm.LMHead` and `moe_sites()` lists the MoE layer, as
`models.lm.HybridLM` does. Compiles in seconds where the full hybrid takes a minute.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import GatedMLA, MLAConfig
from models.lm import LMHead
from core.sharding import logical
from moe.config import MoEConfig
from moe.experts import StableLatentMoE
from train.optim import OptimConfig, make_optimizer
from train.packing import finalize_batch
from train.step import FAST_COMPILE_OPTIONS, TrainState

VOCAB = 264
BATCH, LENGTH = 2, 16
MLA = MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8)
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, latent_dim=8, shared_hidden=16,
                latent_norm=True)


class ToyLM(nnx.Module):
    def __init__(self, d_model: int = 16, *, moe_dtype=jnp.float32, moe: MoEConfig = MOE,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(
            VOCAB, d_model, rngs=rngs,
            embedding_init=logical(nnx.initializers.normal(1.0), ("vocab", "embed")),
        )
        self.attention = GatedMLA(d_model, MLA, rngs=rngs)
        self.moe = StableLatentMoE(d_model, moe, dtype=moe_dtype, rngs=rngs)
        self.lm_head = LMHead(d_model, VOCAB, dtype=jnp.float32, param_dtype=jnp.float32,
                              rngs=rngs)

    def forward(self, tokens, segment_ids=None, *, return_hidden=False):
        x = self.embed(tokens)
        x = x + self.attention(x, segment_ids=segment_ids)
        routed, stats = self.moe(x, segment_ids)
        hidden = x + routed.astype(x.dtype)
        return (hidden if return_hidden else self.lm_head(hidden)), (stats,)

    def __call__(self, tokens, segment_ids=None):
        return self.forward(tokens, segment_ids)[0]

    def moe_sites(self):
        return [(self.moe, False)]


def make_batch(seed: int = 0) -> dict[str, jax.Array]:
    """A batch [BATCH, LENGTH]: two packed documents per row, every next token a target."""
    rng = np.random.default_rng(seed)
    segment_ids = np.repeat(np.array([[1, 2]]), LENGTH // 2, axis=1).repeat(BATCH, axis=0)
    rows = {
        "tokens": rng.integers(0, 256, (BATCH, LENGTH)).astype(np.int32),
        "target_mask": np.ones((BATCH, LENGTH), np.float32),
        "tokens_segment_ids": segment_ids.astype(np.int32),
        "tokens_positions": np.tile(np.arange(LENGTH // 2), (BATCH, 2)).astype(np.int32),
    }
    return {key: jnp.asarray(value) for key, value in finalize_batch(rows).items()}


def split_state(optim: OptimConfig = OptimConfig(warmup_steps=0), seed: int = 0,
                moe_dtype=jnp.float32):
    """(graphdef, state) of a TrainState of ToyLM (its MoE computing in `moe_dtype`), built by
    one jitted program."""

    def build():
        model = ToyLM(moe_dtype=moe_dtype, rngs=nnx.Rngs(seed))
        return TrainState(model, make_optimizer(optim, nnx.state(model, nnx.Param), 100))

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    return graphdef, jax.jit(lambda: nnx.state(build()), compiler_options=FAST_COMPILE_OPTIONS)()
