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

    A custom VJP keeps params and chunks, nothing of fn's inside. The forward is a loop over the
    chunks; the backward another, which recomputes chunk i's forward, runs its VJP, adds its
    parameter cotangents and writes its chunk's: the step holds one chunk's intermediates, and
    the program two copies of fn and of its VJP (chunk 0, then the loop's body) whatever N. Not
    autodiff of `lax.map` under `jax.checkpoint`: that backward sums the parameter cotangents
    and stacks the chunks' in buffers that start as zeros, and XLA, free to place the copies of
    one zero broadcast anywhere, allocated those of every layer at the start of the step (and
    `lax.map`'s own outputs start as zeros too); here they start from chunk 0's (`filled_with`).
    Integer and boolean leaves of chunks get no cotangent.
    """
    return _map_chunks(fn, params, chunks)


def filled_with(piece: jax.Array, count: int, axis: int) -> jax.Array:
    """`count` copies of piece side by side along `axis` ([..., count * n, ...] for piece's n
    there): the buffer a loop writes its other pieces into.

    Started from a piece of the call's own data rather than zeros: XLA shares one zero broadcast
    among all buffers of a shape (every layer's) and may place their copies at the start of the
    program, where they all stay live; this one exists only once the piece does.
    """
    shape = piece.shape
    tiled = jnp.broadcast_to(jnp.expand_dims(piece, axis), shape[:axis] + (count,) + shape[axis:])
    return tiled.reshape(shape[:axis] + (shape[axis] * count,) + shape[axis + 1:])


def _index(tree, index):
    """Slice `index` (an int or a traced scalar) of every [N, ...] leaf."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def _map_chunks_forward(fn, params, chunks):
    def run_chunk(index, outputs):
        return jax.tree.map(lambda buffer, out: jax.lax.dynamic_update_index_in_dim(
            buffer, out, index, 0), outputs, fn(params, _index(chunks, index)))

    num_chunks = len(jax.tree.leaves(chunks)[0])
    outputs = jax.tree.map(lambda out: filled_with(out[None], num_chunks, 0),
                           fn(params, _index(chunks, 0)))
    return jax.lax.fori_loop(1, num_chunks, run_chunk, outputs), (params, chunks)


def _map_chunks_backward(fn, residuals, d_outputs):
    params, chunks = residuals
    leaves, treedef = jax.tree.flatten(chunks)
    inexact = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]

    def chunk_vjp(index):
        """(d_params, the cotangents of the inexact leaves) of chunk `index`."""
        chunk = _index(leaves, index)

        def on_floats(params, floats):
            floats = iter(floats)
            differentiated = [next(floats) if f else leaf for leaf, f in zip(chunk, inexact)]
            return fn(params, jax.tree.unflatten(treedef, differentiated))

        floats = [leaf for leaf, f in zip(chunk, inexact) if f]
        _, vjp = jax.vjp(on_floats, params, floats)
        return vjp(_index(d_outputs, index))

    def add_chunk(index, carry):
        d_params, d_floats = carry
        d_params_now, d_chunk = chunk_vjp(index)
        d_floats = [jax.lax.dynamic_update_index_in_dim(buffer, d, index, 0)
                    for buffer, d in zip(d_floats, d_chunk)]
        return jax.tree.map(jnp.add, d_params, d_params_now), d_floats

    num_chunks = len(leaves[0])
    d_params, d_first = chunk_vjp(0)
    d_floats = [filled_with(d[None], num_chunks, 0) for d in d_first]
    d_params, d_floats = jax.lax.fori_loop(1, num_chunks, add_chunk, (d_params, d_floats))
    d_floats = iter(d_floats)
    return d_params, jax.tree.unflatten(treedef, [next(d_floats) if f else None for f in inexact])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _map_chunks(fn, params, chunks):
    return _map_chunks_forward(fn, params, chunks)[0]


_map_chunks.defvjp(_map_chunks_forward, _map_chunks_backward)
