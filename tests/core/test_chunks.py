"""core.chunks: [B, T, ...] arrays cut into chunks of every row along T, and put back."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from core.chunks import map_chunks, merge_chunks, split_chunks


def test_chunks_hold_consecutive_positions_of_every_row_and_the_tail_is_zero_padded():
    x = jnp.arange(2 * 7 * 3).reshape(2, 7, 3)
    chunks = split_chunks(x, 3)
    assert chunks.shape == (3, 2, 3, 3)  # [chunks, B, chunk_tokens, ...]
    np.testing.assert_array_equal(chunks[1], x[:, 3:6])
    np.testing.assert_array_equal(chunks[2, :, 0], x[:, 6])
    np.testing.assert_array_equal(chunks[2, :, 1:], 0)
    np.testing.assert_array_equal(merge_chunks(chunks, 7), x)
    mask = split_chunks(jnp.ones((2, 7), bool), 3)
    assert mask.dtype == bool and mask.shape == (3, 2, 3) and not mask[2, :, 1:].any()


def gated_chunk(params, chunk):
    """A per-token function of weights and a chunk (x float, mask bool): (y, a scalar)."""
    w, b = params
    x, mask = chunk
    y = jnp.where(mask[..., None], jnp.tanh(x @ w) + b, 0.0)
    return y, jnp.sum(y ** 2)


def test_map_chunks_equals_the_chunks_one_by_one_with_gradients():
    keys = jax.random.split(jax.random.key(0), 3)
    params = (jax.random.normal(keys[0], (4, 5)), jax.random.normal(keys[1], (5,)))
    x = jax.random.normal(keys[2], (3, 2, 6, 4))  # [N, B, chunk, D]
    mask = jnp.arange(3 * 2 * 6).reshape(3, 2, 6) % 4 != 0

    def loss(run, params, x):
        y, squares = run(params, (x, mask))
        return jnp.sum(jnp.sin(y)) + jnp.sum(squares)

    def one_by_one(params, chunks):
        outputs = [gated_chunk(params, (chunks[0][i], chunks[1][i])) for i in range(3)]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outputs)

    def mapped(params, chunks):
        return map_chunks(gated_chunk, params, chunks)

    got = jax.jit(jax.value_and_grad(functools.partial(loss, mapped), (0, 1)))(params, x)
    want = jax.value_and_grad(functools.partial(loss, one_by_one), (0, 1))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
