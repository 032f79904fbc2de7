"""Sequence chunks: [B, T, ...] arrays cut along T into chunks of every row, and put back.

A chunk holds `chunk_tokens` consecutive positions of every row ([B, chunk_tokens, ...]), so an
array sharded over the batch stays sharded the same way chunk by chunk. Layers that are
per-token run chunk by chunk to hold one chunk's intermediates at a time (`map_chunks`), as the
MoE layer does under `MoEConfig.token_chunk` (`moe.experts.StableLatentMoE`); `train.step`'s
chunked LM-head loss cuts its rows the same way.
"""

import functools
from collections.abc import Callable

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


def map_chunks(fn: Callable, params, chunks):
    """fn(params, chunk i) for every chunk, one chunk at a time in the forward and the backward
    pass: outputs stacked [N, ...].

    params: a pytree of arrays every chunk uses (weights); chunks: a pytree of [N, ...] arrays
    (`split_chunks`), chunk i their [i] slices; fn returns a pytree of arrays.

    A custom VJP keeps params and chunks, nothing of fn's inside; the backward recomputes chunk
    i's forward, runs its VJP and adds its parameter cotangents, chunk after chunk, each
    recomputation held back until the chunk before has all its cotangents (an optimization
    barrier), so the step holds one chunk's intermediates. Not `lax.map` under `jax.checkpoint`:
    that backward's while loop sums the parameter cotangents and stacks the chunks' in buffers
    that start as zeros, and XLA, free to place the copies of one zero broadcast anywhere,
    allocated those of every layer at the start of the step. Integer and boolean leaves of
    chunks get no cotangent.
    """
    return _map_chunks(fn, params, chunks)


def _chunk(chunks, index: int):
    return jax.tree.map(lambda a: a[index], chunks)


def _stacked(outputs: list):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outputs)


def _map_chunks_forward(fn, params, chunks):
    num_chunks = len(jax.tree.leaves(chunks)[0])
    outputs = _stacked([fn(params, _chunk(chunks, i)) for i in range(num_chunks)])
    return outputs, (params, chunks)


def _map_chunks_backward(fn, residuals, d_outputs):
    params, chunks = residuals
    leaves, treedef = jax.tree.flatten(chunks)
    inexact = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]

    def on_floats(params, floats, index):
        """fn of chunk `index`, its inexact leaves given (the differentiated ones)."""
        floats = iter(floats)
        chunk = [next(floats) if f else leaf[index] for leaf, f in zip(leaves, inexact)]
        return fn(params, jax.tree.unflatten(treedef, chunk))

    d_params, d_floats, previous = None, [], None
    for index in range(len(leaves[0])):
        floats = [leaf[index] for leaf, f in zip(leaves, inexact) if f]
        # The recomputation starts only once the chunk before has all its cotangents.
        params_now, floats, previous = jax.lax.optimization_barrier((params, floats, previous))
        _, vjp = jax.vjp(lambda p, xs: on_floats(p, xs, index), params_now, floats)
        d_params_now, d_chunk = vjp(_chunk(d_outputs, index))
        d_params = d_params_now if d_params is None else jax.tree.map(jnp.add, d_params,
                                                                      d_params_now)
        d_floats.append(d_chunk)
        previous = (d_params, d_chunk)
    stacked = iter(_stacked(d_floats))
    d_chunks = [next(stacked) if f else None for f in inexact]
    return d_params, jax.tree.unflatten(treedef, d_chunks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _map_chunks(fn, params, chunks):
    return _map_chunks_forward(fn, params, chunks)[0]


_map_chunks.defvjp(_map_chunks_forward, _map_chunks_backward)
