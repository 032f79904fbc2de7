"""What the Mosaic GPU KDA kernels share: the operand dtype, SMEM tile layouts, how a launch is
jitted, the recurrence kernels' warp-specialized loop over chunks and their state-tile loads and
stores, and the contracts between kernels: the recurrence kernel's operands (between the chunk
preparation and the recurrence over chunks) and the residuals of both forward kernels (between
each and its backward)."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.chunked import ChunkedInputs

OPERAND_DTYPE = jnp.bfloat16  # every wgmma operand; accumulators are float32
SUPPORTED_DIMS = (64, 128)  # K and V; K = 256 would not fit two pipeline stages in shared memory
# The recurrence kernels run two warpgroups on this axis (`plgpu.kernel(num_threads=2,
# thread_name=WARPGROUP_AXIS)`): one computes the chunk steps, one only issues their TMA loads.
WARPGROUP_AXIS = "wg"
# Registers a thread of the loading warpgroup (`plgpu.emit_pipeline_warp_specialized`'s
# docstring suggests 40 for the H100).
MEMORY_REGISTERS = 40


def lowered_once(*static_argnames: str):
    """Decorates a kernel launch with `jax.jit` (its non-array arguments static): launches of
    the same shapes and static arguments anywhere in one program then share one traced and
    lowered kernel. Unjitted, every call site would lower a copy of its own, and lowering Mosaic
    GPU kernels dominates a training step's compile time (`benchmarks/train_h200.md`)."""
    return functools.partial(jax.jit, static_argnames=static_argnames)


def kernel_body(body, **static):
    """`body` with its static arguments bound, under its own name: Mosaic GPU names a kernel
    after its body (in profiles and lowered modules), and a bare `functools.partial` is
    "anonymous"."""
    return functools.update_wrapper(functools.partial(body, **static), body)


def chunk_pipeline(chunk_step, in_specs, num_chunks: int, stages: int, compute_context):
    """The recurrence kernels' loop over chunks, warp-specialized: `chunk_step(indices, *blocks,
    carry) -> carry` runs in the compute warpgroup while the other issues the TMA loads of
    `in_specs` up to `stages` steps ahead. `compute_context(run)` also runs in the compute
    warpgroup only: it gives `run` the initial carry and takes the final one. Call the result on
    the GMEM refs of `in_specs`; the kernel's scoped buffers must be allocated with
    `collective_axes=WARPGROUP_AXIS`, since both warpgroups reach that allocation."""
    return plgpu.emit_pipeline_warp_specialized(
        chunk_step, grid=(num_chunks,), in_specs=in_specs, max_concurrent_steps=stages,
        memory_registers=MEMORY_REGISTERS, wg_axis=WARPGROUP_AXIS, num_compute_wgs=1,
        compute_context=compute_context)


def check_output_cotangent(d_o, chunk_major_shape):
    """Refuses a cotangent of o that is neither [B, HV, N, C, V] = `chunk_major_shape` nor the
    same token-major, [B, N C, HV, V] (as the forward kernel writes o): the two layouts the
    backward's kernels read."""
    batch, heads, num_chunks, chunk, value_dim = chunk_major_shape
    if d_o.shape not in (tuple(chunk_major_shape), (batch, num_chunks * chunk, heads, value_dim)):
        raise ValueError(f"d_o must be [B, HV, N, C, V] = {tuple(chunk_major_shape)} or "
                         f"token-major, [B, N C, HV, V]; got {d_o.shape}")


def cotangent_dtypes(rounded) -> dict:
    """The dtype of each `ChunkedInputs` cotangent: bf16 where `rounded` names it (the consumer
    rounds it so anyway: the same gradients, half the bytes), else float32."""
    return {name: OPERAND_DTYPE if name in rounded else jnp.float32
            for name in ChunkedInputs._fields}


def swizzled(shape, dtype, max_swizzle=128):
    """The (tiling, swizzle) transforms wgmma and TMA want for a [rows, cols] SMEM tile: the
    widest swizzle its rows allow, up to `max_swizzle` bytes (wgmma's two operands from SMEM must
    share one: a narrower right operand caps its left one)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(min(shape[-1] * itemsize, max_swizzle) * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def swizzled_smem(shape, dtype, max_swizzle=128):
    """A `plgpu.SMEM` buffer of `shape` with the `swizzled` transforms of its last two axes."""
    return plgpu.SMEM(shape, dtype, transforms=swizzled(shape[-2:], dtype, max_swizzle))


def load_state_tile(gmem_tile, smem, barrier):
    """A float32 state tile (S [K, 64], or dS transposed) from GMEM into WGMMA-layout registers,
    by TMA through `smem` (float32, swizzled, gmem_tile's shape) and `barrier`, as the recurrence
    kernels start: the initial state forward, the final-state cotangent backward."""
    plgpu.copy_gmem_to_smem(gmem_tile, smem, barrier)
    plgpu.barrier_wait(barrier)
    tile = plgpu.load(smem, layout=plgpu.Layout.WGMMA)
    plgpu.commit_smem()  # the load is done before the memory is written again
    return tile


def store_state_tile(tile, gmem_tile, smem):
    """Writes a float32 state tile from registers to GMEM by TMA through `smem` (float32,
    swizzled, its shape), as the recurrence kernels end: the final state forward, dS_0 backward.
    Waits first for every copy the kernel issued (the last chunk's outputs), whose buffers `smem`
    may share, and then for its own."""
    plgpu.wait_smem_to_gmem(0)
    smem[...] = tile
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem_tile)
    plgpu.wait_smem_to_gmem(0)


class RecurrenceOperands(NamedTuple):
    """`kda.chunked.ChunkedInputs` as the recurrence kernel reads them (bf16 matmul operands).

    Produced from `ChunkedInputs` by `recurrence_operands`, or directly by the preparation
    kernel (`kda.kernels.mosaic_gpu.prepare`).
    """

    W: jax.Array  # bf16 [B, HV, N, C, K]
    U: jax.Array  # float32 [B, HV, N, C, V]
    q_from_state: jax.Array  # bf16 [B, HV, N, C, K]
    k_to_state_t: jax.Array  # bf16 [B, HV, N, K, C]   k_to_state transposed: the wgmma lhs
    Aqk: jax.Array  # bf16 [B, HV, N, C, C]
    chunk_decay: jax.Array  # float32 [B, HV, N, K]


class PreparationResiduals(NamedTuple):
    """What the preparation kernel writes, when a backward will run, for the kernels of its
    backward (`kda.kernels.mosaic_gpu.prepare_backward`: the UT/WY kernel reads all three, the
    score-tile kernel G), which would otherwise recompute them."""

    G: jax.Array  # float32 [B, HV, N, C, K]   cumsum(g) within the chunk
    Akk: jax.Array  # bf16 [B, HV, N, C, C]   k's scores, strictly lower, same document, no beta
    inverse: jax.Array  # bf16 [B, HV, N, 2, C, C]   (I + beta Akk)^-1 as hi and lo parts


class RecurrenceResiduals(NamedTuple):
    """What the forward kernel writes for the backward, the bf16 wgmma operands it used."""

    states: jax.Array  # bf16 [B, HV, N, K, V]   S_n, the state entering chunk n
    v_new: jax.Array  # bf16 [B, HV, N, C, V]    V_new_n


def recurrence_operands(chunks: ChunkedInputs) -> RecurrenceOperands:
    """The kernel's operands from the plain-JAX preparation: bf16 matmul operands, k transposed."""
    as_operand = lambda x: x.astype(OPERAND_DTYPE)  # noqa: E731
    return RecurrenceOperands(
        W=as_operand(chunks.W), U=chunks.U.astype(jnp.float32),
        q_from_state=as_operand(chunks.q_from_state),
        k_to_state_t=as_operand(jnp.swapaxes(chunks.k_to_state, -1, -2)),
        Aqk=as_operand(chunks.Aqk), chunk_decay=chunks.chunk_decay.astype(jnp.float32))
