"""The plain-JAX tiled attention (`models.blockwise_attention`): equal to the dense document mask,
values and gradients, causal and bidirectional, at tile sizes that do and do not divide T; and its
compiled memory does not hold a [T, T] array."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.common import document_index
from models import blockwise_attention
from models.attention import _dense_document_attention
from models.blockwise_attention import blockwise_document_attention


def inputs(batch=2, length=37, heads=3, width=8, dtype=jnp.float32, seed=0):
    """q, k, v, d_out [B, T, H, D] and document_ids [B, T] of a few documents a row."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, d_out = (jax.random.normal(key, (batch, length, heads, width), dtype)
                      for key in keys)
    segment_ids = np.sort(np.random.default_rng(seed).integers(0, 5, (batch, length)), axis=1)
    return q, k, v, d_out, document_index(jnp.asarray(segment_ids))


def output_and_grads(attend, q, k, v, d_out):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(d_out)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [8, 16, 64])  # 37 tokens: padded to 40 and 48, one tile
def test_tiles_equal_the_dense_mask(causal, block):
    q, k, v, d_out, documents = inputs()

    def tiled(q, k, v):
        return blockwise_document_attention(q, k, v, scale=0.3, document_ids=documents,
                                            causal=causal, block=block)

    def dense(q, k, v):
        return _dense_document_attention(q, k, v, scale=0.3, document_ids=documents,
                                         implementation="xla", causal=causal)

    got = output_and_grads(jax.jit(tiled), q, k, v, d_out)
    want = output_and_grads(dense, q, k, v, d_out)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)
    # The documents matter: one document a row gives another answer.
    joined = blockwise_document_attention(q, k, v, scale=0.3, document_ids=None, causal=causal,
                                          block=block)
    assert not np.allclose(joined, want[0], atol=1e-2)


def test_bfloat16_stays_near_float32():
    q, k, v, d_out, documents = inputs(length=64, dtype=jnp.bfloat16)

    def tiled(q, k, v):
        return blockwise_document_attention(q, k, v, scale=0.3, document_ids=documents,
                                            causal=True, block=16)

    got = output_and_grads(tiled, q, k, v, d_out)
    want = output_and_grads(tiled, *(t.astype(jnp.float32) for t in (q, k, v, d_out)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == jnp.bfloat16
        error = np.linalg.norm(np.float32(g) - w) / np.linalg.norm(w)
        assert error < 2e-2


def test_gradient_memory_is_linear_in_length():
    # At T = 4096 a [T, T] float32 array is 64 MiB; the tiles hold a [512, 512] one at a time.
    length = 4096
    q, k, v, d_out, _ = inputs(batch=1, length=length, heads=1, width=8)
    documents = jnp.zeros((1, length), jnp.int32).at[:, length // 2:].set(1)

    def loss(q, k, v):
        out = blockwise_document_attention(q, k, v, scale=0.3, document_ids=documents,
                                           causal=True)
        return jnp.sum(out * d_out)

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 16 * 2**20
    assert blockwise_attention.BLOCK_TOKENS ** 2 * 4 < 16 * 2**20 < length ** 2 * 4
