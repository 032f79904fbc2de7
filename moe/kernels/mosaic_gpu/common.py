"""What the MoE's Mosaic GPU grouped GEMMs share: the persistent warp-specialized launch, the
SM count it is sized by, swizzled SMEM layouts, whole-slab epilogue stores, and group bounds.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe.kernels.mosaic_gpu.tiling import COMPUTE_WARPGROUPS, HOPPER_SMS


def persistent_kernel(body, out_type, num_tiles: int):
    """`plgpu.kernel(body)` with one program an SM (at most one a tile), each running the
    consumer warpgroups and the producer warpgroup on the "wg" axis; programs on "sm"."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(min(sm_count(), num_tiles),),
        grid_names=("sm",),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
    )


def sm_count() -> int:
    """SMs of the device the kernel is built for (an abstract mesh's, for interpret mode)."""
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    if abstract_device is not None:
        return abstract_device.num_cores
    device = jax.devices()[0]
    return getattr(device, "core_count", None) or HOPPER_SMS


def no_op_body(*_, **__):
    """A pipeline body for building a pipeline only to ask for its allocations."""


def swizzled(columns: int, dtype) -> tuple[plgpu.Transform, ...]:
    """SMEM transforms of a tile whose rows are `columns` elements: the widest swizzle that fits."""
    swizzle = plgpu.find_swizzle(columns * jnp.dtype(dtype).itemsize * 8)
    swizzle_elements = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, swizzle_elements)), plgpu.SwizzleTransform(swizzle)


def store_slab(values, destinations, swizzled_smem, first_row):
    """Stores a consumer's whole slab: values(chunk) -> [R, len(chunk)] values, one for each of
    `destinations` [M, C], to rows first_row + [0, R), a chunk at a time through swizzled_smem
    [2, R, E] (double-buffered: a chunk is written while the previous one's store runs)."""
    rows = swizzled_smem.shape[1]
    slot = 0
    for chunk in column_chunks(destinations[0].shape[1], swizzled_smem.shape[-1]):
        for value, destination in zip(values(chunk), destinations):
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store that last read slot
            swizzled_smem[slot] = value
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                swizzled_smem.at[slot], destination.at[pl.ds(first_row, rows), chunk]
            )
            slot = 1 - slot


def column_chunks(columns: int, width: int) -> list[slice]:
    """Consecutive `width`-column slices covering `columns` (a multiple of width)."""
    return [slice(start, start + width) for start in range(0, columns, width)]


def group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """The first and end (exclusive) row of each group, both [G] int32, clipped to num_rows."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends

