"""The chunk recurrence two ways for the kernel tests, plain JAX (`chunk_recurrence`, the oracle)
and the Mosaic GPU kernels (`kernel_recurrence`), with their VJP under one jit, and abstract
recurrence operands for lowering the kernels for Hopper.

Both recurrences take float32 `ChunkedInputs` [B, HV, N, C, ...] and an initial state
[B, HV, K, V] and give (o [B, HV, N, C, V] in bf16, final state [B, HV, K, V] float32).
"""

import jax
import jax.numpy as jnp

from kda.chunked import CHUNK_SIZE, chunk_recurrence
from kda.kernels.mosaic_gpu import op as mosaic_gpu
from kda.kernels.mosaic_gpu.common import RecurrenceOperands


def plain_recurrence(chunks, initial_state):
    return chunk_recurrence(chunks, initial_state, jnp.bfloat16)


def kernel_recurrence(chunks, initial_state):
    return mosaic_gpu.kernel_recurrence(chunks, initial_state, jnp.bfloat16)


def jitted_vjp(recurrence):
    """`(chunks, initial_state, cotangents) -> (d_chunks, d_initial_state)` under one jit."""
    return jax.jit(lambda chunks, initial_state, cotangents: jax.vjp(
        recurrence, chunks, initial_state)[1](cotangents))


def abstract_operands(batch, heads, num_chunks, dim):
    """(`RecurrenceOperands`, initial state) as `jax.ShapeDtypeStruct`s, K = V = dim: what
    lowering a recurrence kernel for Hopper needs."""
    shapes = dict(W=(CHUNK_SIZE, dim), U=(CHUNK_SIZE, dim), q_from_state=(CHUNK_SIZE, dim),
                  k_to_state_t=(dim, CHUNK_SIZE), Aqk=(CHUNK_SIZE, CHUNK_SIZE), chunk_decay=(dim,))
    operands = RecurrenceOperands(**{
        name: jax.ShapeDtypeStruct((batch, heads, num_chunks, *shape),
                                   jnp.float32 if name in ("U", "chunk_decay") else jnp.bfloat16)
        for name, shape in shapes.items()})
    return operands, jax.ShapeDtypeStruct((batch, heads, dim, dim), jnp.float32)
