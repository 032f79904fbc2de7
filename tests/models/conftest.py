"""What the generation tests share: one small hybrid with every layer kind, built once a module."""

import dataclasses

import jax
import pytest
from flax import nnx

from models.config import preset
from models.lm import HybridLM


@pytest.fixture(scope="module")
def model():
    """Four layers: KDA at 1 (with the dense FFN) and 3, Gated MLA at 2 and 4 (the MoE from layer
    2 on). KDA runs its recurrent oracle: the same model maths, a faster compile on CPU. Cached
    MLA reads two pages per block, so the tests' prompts of a few pages take several blocks, the
    last one partly past the table."""
    cfg = preset("tiny", num_layers=4, kda_layers=(1, 3), full_attn_layers=(2, 4))
    cfg = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, impl="reference"),
                              mla=dataclasses.replace(cfg.mla, cache_pages_per_block=2))
    return HybridLM(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def full_forward():
    """The jitted full forward, logits [B, T, V] float32, that decoding must reproduce."""
    return jax.jit(lambda model, tokens: model(tokens))
