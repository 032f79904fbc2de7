"""Weight-gradient grouped GEMM for Hopper (Pallas Mosaic GPU): out[g] = lhs[rows of g]^T @
out_grad[rows of g], [G, K, N] in lhs.dtype, accumulated in float32 (JAX's bundled
`transposed_ragged_dot_mgpu` computes the same).

`ragged_matmul`'s design with the rows as the contraction: one persistent program an SM walks
(group, K block, N block) output tiles, a producer warpgroup issuing TMA loads and two consumer
warpgroups each owning 64 rows of K; a tile's pipeline walks the row steps that hold rows of its
group (a dynamic number of them). A step that straddles a group boundary is loaded whole; each
consumer zeroes the other groups' rows in its 64 columns of the lhs tile and in half the
out_grad tile (which both read: a barrier) before the wgmmas, so rows past the total left
unwritten (NaN, say) contribute nothing either. Tiles do not overlap as a pipeline of pipelines
(Pallas allows that only for a static step count), but the producer loads a tile's first stages
while the consumers store the previous tile. Tiles: `moe.kernels.mosaic_gpu.tiling`.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe.kernels.mosaic_gpu.common import (
    group_bounds,
    no_op_body,
    persistent_kernel,
    store_slab,
    swizzled,
)
from moe.kernels.mosaic_gpu.tiling import (
    COMPUTE_WARPGROUPS,
    PRODUCER_REGISTERS,
    SUPPORTED_DTYPES,
    TRANSPOSED_DEFAULT_CONFIG,
    TRANSPOSED_TILE_K,
    WGMMA_ROWS,
    TransposedRaggedMatmulConfig,
)


@functools.partial(jax.jit, static_argnames=("config",))
def transposed_ragged_matmul(
    lhs: jax.Array,
    out_grad: jax.Array,
    group_sizes: jax.Array,
    *,
    config: TransposedRaggedMatmulConfig = TRANSPOSED_DEFAULT_CONFIG,
) -> jax.Array:
    """Each group's rows of lhs, transposed, times its rows of out_grad, on a Hopper GPU: the
    weight gradient of `ragged_matmul`.

    Args:
        lhs: [R, K] bf16 or f16, rows sorted by group.
        out_grad: [R, N] in lhs.dtype, rows as lhs's.
        group_sizes: [G] integer rows per group, summing to at most R.
        config: tile settings; K must be a multiple of TRANSPOSED_TILE_K and N of tile_n.

    Returns:
        [G, K, N] in lhs.dtype (as JAX's bundled `transposed_ragged_dot`): out[g] =
        lhs[rows of g]^T @ out_grad[rows of g], accumulated in float32; zeros for empty groups.
        Rows at or past sum(group_sizes) contribute nothing, even unwritten ones holding NaN.
    """
    num_rows, contraction, columns = _checked_transposed_shape(lhs, out_grad, group_sizes, config)
    num_groups = group_sizes.shape[0]
    bounds = jnp.stack(group_bounds(group_sizes, num_rows))
    num_tiles = num_groups * (contraction // TRANSPOSED_TILE_K) * (columns // config.tile_n)
    kernel = persistent_kernel(
        functools.partial(_transposed_kernel_body, config=config),
        jax.ShapeDtypeStruct((num_groups, contraction, columns), lhs.dtype),
        num_tiles,
    )
    return kernel(bounds, lhs, out_grad)


def _checked_transposed_shape(lhs, out_grad, group_sizes, config):
    """(R, K, N) of a call, or a ValueError naming what does not fit."""
    if lhs.ndim != 2 or out_grad.ndim != 2 or lhs.shape[0] != out_grad.shape[0]:
        raise ValueError(
            f"transposed_ragged_matmul needs lhs [R, K] and out_grad [R, N] with the same rows, "
            f"got lhs {lhs.shape} and out_grad {out_grad.shape}."
        )
    (num_rows, contraction), columns = lhs.shape, out_grad.shape[1]
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be integers of shape [G], got {group_sizes.dtype} "
            f"{group_sizes.shape}."
        )
    if lhs.dtype not in SUPPORTED_DTYPES or out_grad.dtype != lhs.dtype:
        raise ValueError(
            f"lhs and out_grad must both be bfloat16 or both float16, got {lhs.dtype} and "
            f"{out_grad.dtype}; cast them first."
        )
    if contraction % TRANSPOSED_TILE_K or columns % config.tile_n:
        raise ValueError(
            f"K={contraction} must be a multiple of {TRANSPOSED_TILE_K} and N={columns} of "
            f"tile_n={config.tile_n}; choose a config whose tile_n divides N."
        )
    if num_rows == 0 or group_sizes.shape[0] == 0:
        raise ValueError(
            f"lhs needs a row and group_sizes a group, got {lhs.shape} and {group_sizes.shape}."
        )
    return num_rows, contraction, columns


def _transposed_kernel_body(bounds_gmem, lhs_gmem, out_grad_gmem, out_gmem, *, config):
    """One persistent program over (group, K block, N block) output tiles.

    bounds_gmem: [2, G] int32 first and end row of each group (clipped to R); lhs_gmem: [R, K];
    out_grad_gmem: [R, N]; out_gmem: [G, K, N]. A tile's pipeline walks the tile_rows-row steps
    that hold rows of its group (aligned to tile_rows, so a dynamic number of them); in a step
    that also holds rows of other groups (or past the total), each consumer zeroes those rows of
    its own 64 columns of the lhs tile and of half the out_grad tile before the wgmmas read them
    (both tiles: a non-finite value in either would survive a product with a zero).
    """
    dtype = lhs_gmem.dtype
    num_groups, contraction, columns = out_gmem.shape
    tile_n, tile_rows = config.tile_n, config.tile_rows
    k_blocks, n_blocks = contraction // TRANSPOSED_TILE_K, columns // tile_n

    def pipeline(first_step, steps, k_block, n_block, body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=PRODUCER_REGISTERS,
            in_specs=[
                plgpu.BlockSpec(
                    (tile_rows, TRANSPOSED_TILE_K),
                    lambda step: (first_step + step, k_block),
                    transforms=swizzled(TRANSPOSED_TILE_K, dtype),
                ),
                plgpu.BlockSpec(
                    (tile_rows, tile_n),
                    lambda step: (first_step + step, n_block),
                    transforms=swizzled(tile_n, dtype),
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WARPGROUPS,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    # A static grid of max_concurrent_steps steps allocates every stage a dynamic one uses.
    allocations = pipeline(
        0, config.max_concurrent_steps, 0, 0, no_op_body, no_op_body
    ).get_allocations(lhs_gmem, out_grad_gmem)
    scratch = dict(
        pipeline_allocs=allocations,
        swizzled_smem=plgpu.SMEM(
            (COMPUTE_WARPGROUPS, 2, WGMMA_ROWS, config.epilogue_tile_n),
            dtype,
            transforms=swizzled(config.epilogue_tile_n, dtype),
        ),
        # Both consumers have zeroed their halves of a step's tiles (other groups' rows).
        zeroed_barrier=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
    )

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(pipeline_allocs, swizzled_smem, zeroed_barrier):
        consumer = lax.axis_index("wg")

        @plgpu.nd_loop((num_groups * k_blocks * n_blocks,), collective_axes="sm")
        def _tile_loop(loop_info: plgpu.NDLoopInfo):
            # Group-major: the tiles running at once share a group's rows, read through L2.
            tile = loop_info.index[0]
            group = lax.div(tile, jnp.int32(k_blocks * n_blocks))
            k_block = lax.div(lax.rem(tile, jnp.int32(k_blocks * n_blocks)), jnp.int32(n_blocks))
            n_block = lax.rem(tile, jnp.int32(n_blocks))
            start, end = bounds_gmem[0, group], bounds_gmem[1, group]
            first_step = lax.div(start, jnp.int32(tile_rows))
            steps = jnp.where(end > start, pl.cdiv(end, tile_rows) - first_step, 0)

            def zero_other_rows(tile_smem, first_row):
                rows = first_row + plgpu.layout_cast(
                    lax.broadcasted_iota(jnp.int32, tile_smem.shape, 0), plgpu.Layout.WGMMA
                )
                own_rows = (rows >= start) & (rows < end)
                tile_smem[...] = jnp.where(own_rows, tile_smem[...], 0).astype(dtype)

            def multiply(indices, lhs_smem, out_grad_smem, acc_ref):
                first_row = (first_step + indices[0]) * tile_rows
                # The consumer's 64 columns of the lhs tile, which only it reads, and its half of
                # the out_grad tile, which both read (hence the barrier). Slices of whole
                # 64-column swizzle rows.
                own_lhs = lhs_smem.at[:, pl.ds(consumer * WGMMA_ROWS, WGMMA_ROWS)]
                half = tile_n // COMPUTE_WARPGROUPS
                own_out_grad = out_grad_smem.at[:, pl.ds(consumer * half, half)]

                @pl.when((first_row < start) | (first_row + tile_rows > end))
                def _zero_other_rows():
                    zero_other_rows(own_lhs, first_row)
                    zero_other_rows(own_out_grad, first_row)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(zeroed_barrier)
                    plgpu.barrier_wait(zeroed_barrier)

                plgpu.wgmma(acc_ref, own_lhs.transpose((1, 0)), out_grad_smem)

                # Released as soon as the wgmma is done; the other consumer's wgmma runs
                # meanwhile (as `ragged_matmul`'s multiply).
                plgpu.wgmma_wait(0)
                return acc_ref

            def consume(run_pipeline):
                @functools.partial(
                    pl.run_scoped, acc_ref=plgpu.ACC((WGMMA_ROWS, tile_n), jnp.float32)
                )
                def _accumulate(acc_ref):
                    run_pipeline(acc_ref)
                    out = acc_ref[...].astype(dtype)
                    # The previous tile's stores must have read the SMEM this one overwrites.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    store_slab(
                        lambda chunk: [out[:, chunk]],
                        [out_gmem.at[group, :, pl.ds(n_block * tile_n, tile_n)]],
                        swizzled_smem.at[consumer],
                        k_block * TRANSPOSED_TILE_K + consumer * WGMMA_ROWS,
                    )

            pipeline(first_step, steps, k_block, n_block, multiply, consume)(
                lhs_gmem, out_grad_gmem, allocations=pipeline_allocs
            )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

