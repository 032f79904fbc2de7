"""Sequence chunks: [B, T, ...] arrays cut along T into chunks of every row, and put back.

A chunk holds `chunk_tokens` consecutive positions of every row ([B, chunk_tokens, ...]), so an
array sharded over the batch stays sharded the same way chunk by chunk. Layers that are
per-token map over chunks (`jax.lax.map`) to hold one chunk's intermediates at a time, as the MoE
layer does under `MoEConfig.token_chunk` (`moe.experts.StableLatentMoE`); `train.step`'s chunked
LM-head loss cuts its rows the same way.
"""

import jax
import jax.numpy as jnp


def split_chunks(x: jax.Array, chunk_tokens: int) -> jax.Array:
    """[B, T, ...] -> [ceil(T / chunk_tokens), B, chunk_tokens, ...], the tail zero-padded
    (zeros of x's dtype: 0, 0.0 or False)."""
    batch, length = x.shape[:2]
    chunks = -(-length // chunk_tokens)
    padding = [(0, 0), (0, chunks * chunk_tokens - length)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, padding).reshape(batch, chunks, chunk_tokens, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1)


def merge_chunks(x: jax.Array, length: int) -> jax.Array:
    """[chunks, B, chunk_tokens, ...] -> [B, length, ...]: `split_chunks` undone, padding cut."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]
