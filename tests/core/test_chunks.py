"""core.chunks: [B, T, ...] arrays cut into chunks of every row along T, and put back."""

import jax.numpy as jnp
import numpy as np

from core.chunks import merge_chunks, split_chunks


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
