"""Row-ragged grouped GEMM for Hopper (Pallas Mosaic GPU): out[rows of g] = lhs[rows of g] @ rhs[g].

lhs [M, K] (rows sorted by group), rhs [G, K, N], bf16 or f16, float32 accumulation, out [M, N]
in lhs.dtype; rows at or past sum(group_sizes) are left unwritten (as JAX's `ragged_dot_mgpu`).
One persistent program an SM walks (row block, column block) tiles of the output with three
warpgroups: a producer that only issues TMA loads (`plgpu.emit_pipeline_warp_specialized`) and
two consumers that each own half the tile's rows (by default 64 x 256: the m64n256k16 wgmma, a
128-register float32 accumulator a thread). The consumers share each stage's lhs and rhs tiles;
while one waits for its wgmma the other's runs, so a stage is released as soon as its wgmma is
done. Consecutive tiles form a pipeline of pipelines (`overlap_tiles`): the producer loads the
next tile's first stages while the consumers finish and store the current one.

Ragged rows: work item w is one (group, row block) pair; a row block straddling a group boundary
is computed once for each of its groups, each storing only its own rows. The work table (group,
first row, end row; `work_table`) is a few small XLA ops ahead of the kernel, so a tile reads
three scalars instead of scanning all groups and the tile loop covers exactly the valid tiles.

Epilogue: a consumer's rows wholly inside the group leave through a swizzled SMEM tile and one
TMA store per epilogue chunk, double-buffered; rows cut by a group boundary leave through a plain
SMEM tile and a ladder of power-of-two-row TMA stores (TMA boxes have static sizes; a swizzled
tile can only be sliced at multiples of 8 rows).

GLU variants (the expert MLP's activation in the epilogues, `moe.dispatch.fused_expert_mlp`):
`ragged_matmul_glu` computes output columns j from the gate columns j and the up columns N + j
of rhs (two accumulators a consumer) and stores gate, up and activation(gate, up);
`ragged_matmul_glu_grad` loads the saved gate and up tiles while its pipeline runs and stores the
activation's VJP (`jax.vjp`'s, float32) applied to the product. Tiles: `.tiling`; the weight
gradient: `.transposed_ragged_matmul` (both in `moe.kernels.mosaic_gpu`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.extend.core
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe.kernels.mosaic_gpu.common import (
    column_chunks,
    group_bounds,
    no_op_body,
    persistent_kernel,
    store_slab,
    swizzled,
)
from moe.kernels.mosaic_gpu.tiling import (
    COMPUTE_WARPGROUPS,
    DEFAULT_CONFIG,
    GLU_CONFIG,
    PRODUCER_REGISTERS,
    SUPPORTED_DTYPES,
    TMA_ALIGNMENT,
    RaggedMatmulConfig,
)

Activation = Callable[[jax.Array, jax.Array], jax.Array]


def ragged_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    config: RaggedMatmulConfig = DEFAULT_CONFIG,
) -> jax.Array:
    """Rows of `lhs` grouped consecutively, each group times its own matrix, on a Hopper GPU.

    Args:
        lhs: [M, K] bf16 or f16, rows sorted by group.
        rhs: [G, K, N] one matrix per group ([G, N, K] with transpose_rhs=True), lhs.dtype.
        group_sizes: [G] integer rows per group, summing to at most M.
        transpose_rhs: whether rhs holds each group's matrix transposed.
        config: tile settings; K must be a multiple of tile_k and N of tile_n.

    Returns:
        [M, N] in lhs.dtype; rows at or past sum(group_sizes) are left unwritten.
    """
    _checked_shape(lhs, rhs, group_sizes, transpose_rhs, config)
    out_type = jax.ShapeDtypeStruct((lhs.shape[0], _columns(rhs, transpose_rhs)), lhs.dtype)
    return _launch(_Epilogue(), lhs, rhs, group_sizes, (), out_type, transpose_rhs, config)


def ragged_matmul_glu(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    activation: Activation,
    *,
    transpose_rhs: bool = False,
    config: RaggedMatmulConfig = GLU_CONFIG,
) -> tuple[jax.Array, jax.Array]:
    """`ragged_matmul` into gate and up columns, with a GLU activation in the epilogue.

    A program's tile is tile_n columns j of the output: the gate columns j and the up columns
    N + j of rhs, one accumulator each, from one shared lhs tile.

    Args:
        lhs: [M, K] bf16 or f16, rows sorted by group.
        rhs: [G, K, 2N] gate columns [0, N) and up columns [N, 2N) ([G, 2N, K] with
            transpose_rhs=True), lhs.dtype.
        group_sizes: [G] integer rows per group, summing to at most M.
        activation: float32 elementwise `act(gate, up)` (as `moe.activations.fused_glu` takes),
            applied to the bf16-rounded gate and up.
        transpose_rhs: whether rhs holds each group's matrix transposed.
        config: tile settings; tile_n counts output (N) columns; N must be a multiple of it.

    Returns:
        gate_up: [M, 2, N] the product (the activation's residual for the backward).
        out: [M, N] activation(gate, up), in lhs.dtype.
        Rows at or past sum(group_sizes) are left unwritten in both.
    """
    num_rows, _, both_columns = _checked_shape(lhs, rhs, group_sizes, transpose_rhs, config)
    if both_columns % (2 * config.tile_n):
        raise ValueError(
            f"rhs {rhs.shape} must hold 2N columns (gate, then up) with N a multiple of "
            f"tile_n={config.tile_n}, got 2N={both_columns}; choose a config whose tile_n "
            "divides N."
        )
    columns = both_columns // 2
    out_types = (
        jax.ShapeDtypeStruct((num_rows, 2 * columns), lhs.dtype),
        jax.ShapeDtypeStruct((num_rows, columns), lhs.dtype),
    )
    gate_up, out = _launch(_Epilogue("glu", activation), lhs, rhs, group_sizes, (), out_types,
                           transpose_rhs, config)
    return gate_up.reshape(num_rows, 2, columns), out


def ragged_matmul_glu_grad(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    gate_up: jax.Array,
    activation: Activation,
    *,
    transpose_rhs: bool = False,
    config: RaggedMatmulConfig = GLU_CONFIG,
) -> jax.Array:
    """The cotangent of a GLU's gate_up, given the product `ragged_matmul(lhs, rhs)` as the
    cotangent of its output: the activation's VJP in the epilogue.

    Args:
        lhs: [M, K] bf16 or f16 (the GLU output's cotangent times the next layer's weights:
            lhs = d_y, rhs = w_out with transpose_rhs=True), rows sorted by group.
        rhs: [G, K, N] ([G, N, K] with transpose_rhs=True), lhs.dtype.
        group_sizes: [G] integer rows per group, summing to at most M.
        gate_up: [M, 2, N] the GLU's saved input (`ragged_matmul_glu`'s first result), lhs.dtype.
        activation: the float32 `act(gate, up)`; its VJP is `jax.vjp`'s, in float32, at the
            saved gate and up applied to the bf16-rounded product.
        transpose_rhs, config: as in `ragged_matmul_glu`.

    Returns:
        [M, 2, N] (d_gate, d_up) in lhs.dtype; rows at or past sum(group_sizes) are left
        unwritten.
    """
    num_rows, _, columns = _checked_shape(lhs, rhs, group_sizes, transpose_rhs, config)
    if gate_up.shape != (num_rows, 2, columns) or gate_up.dtype != lhs.dtype:
        raise ValueError(
            f"gate_up must be [M, 2, N] = {(num_rows, 2, columns)} in {lhs.dtype}, got "
            f"{gate_up.dtype} {gate_up.shape}; pass ragged_matmul_glu's first result."
        )
    out_type = jax.ShapeDtypeStruct((num_rows, 2 * columns), lhs.dtype)
    grad = _launch(_Epilogue("glu_grad", activation), lhs, rhs, group_sizes,
                   (gate_up.reshape(num_rows, 2 * columns),), out_type, transpose_rhs, config)
    return grad.reshape(num_rows, 2, columns)




# Jitted, like every kernel launch here and in `kda.kernels` (`lowered_once` there): identical
# launches in one program share one traced and lowered kernel instead of lowering one each.
@functools.partial(jax.jit, static_argnames=("epilogue", "out_type", "transpose_rhs", "config"))
def _launch(epilogue, lhs, rhs, group_sizes, extra_inputs, out_type, transpose_rhs, config):
    """Runs `_kernel_body` on checked operands; the tile loop spans out_type's last [M, N]."""
    num_rows, contraction = lhs.shape
    columns = _columns(rhs, transpose_rhs) // epilogue.accumulators
    table, work_count = work_table(group_sizes, num_rows, config.tile_m)
    max_tiles = table.shape[1] * (columns // config.tile_n)
    body = functools.partial(
        _kernel_body,
        config=config,
        transpose_rhs=transpose_rhs,
        contraction=contraction,
        epilogue=epilogue,
    )
    kernel = persistent_kernel(body, out_type, max_tiles)
    return kernel(table, work_count, lhs, rhs, *extra_inputs)


def _columns(rhs, transpose_rhs: bool) -> int:
    return rhs.shape[1] if transpose_rhs else rhs.shape[2]



def work_table(
    group_sizes: jax.Array, num_rows: int, tile_m: int
) -> tuple[jax.Array, jax.Array]:
    """The (group, row block) work items of the row dimension, in row order.

    A row block that straddles group boundaries gives one item per group it holds rows of; empty
    groups give none; rows at or past sum(group_sizes) (or M) give none.

    Args:
        group_sizes: [G] integer rows per group.
        num_rows: M, the rows of lhs.
        tile_m: rows of a block.

    Returns:
        table: [3, W] int32 with W = ceil(M / tile_m) + G - 1 (the most items there can be):
            the group, first row and end row (exclusive) of item w; items past the count hold
            group 0 and no rows.
        count: [1] int32, how many items are valid.
    """
    num_groups = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, num_rows)
    first_block = starts // tile_m
    blocks = jnp.where(ends > starts, (ends - 1) // tile_m - first_block + 1, 0)
    items_end = jnp.cumsum(blocks)
    max_items = pl.cdiv(num_rows, tile_m) + num_groups - 1
    item = jnp.arange(max_items, dtype=jnp.int32)
    # compare_all: one fused [W, G] comparison, not a loop of small kernels ahead of the GEMM.
    group = jnp.searchsorted(items_end, item, side="right", method="compare_all")
    group = jnp.minimum(group, num_groups - 1)
    group = group.astype(jnp.int32)
    block = first_block[group] + item - (items_end[group] - blocks[group])
    valid = item < items_end[-1]
    row_start = jnp.where(valid, jnp.maximum(starts[group], block * tile_m), 0)
    row_end = jnp.where(valid, jnp.minimum(ends[group], (block + 1) * tile_m), 0)
    table = jnp.stack([jnp.where(valid, group, 0), row_start, row_end])
    return table, items_end[-1:]



def _checked_shape(lhs, rhs, group_sizes, transpose_rhs, config):
    """(M, K, N) of a call, or a ValueError naming what does not fit."""
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(
            f"ragged_matmul needs lhs [M, K] and rhs [G, K, N] ([G, N, K] with transpose_rhs), "
            f"got lhs {lhs.shape} and rhs {rhs.shape}."
        )
    num_rows, contraction = lhs.shape
    num_groups = rhs.shape[0]
    rhs_contraction, columns = rhs.shape[2:0:-1] if transpose_rhs else rhs.shape[1:]
    layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
    if rhs_contraction != contraction:
        raise ValueError(
            f"rhs {rhs.shape} read as {layout} contracts {rhs_contraction}, but lhs {lhs.shape} "
            f"has K={contraction}; pass transpose_rhs={not transpose_rhs} if rhs is the other "
            "layout."
        )
    if group_sizes.shape != (num_groups,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be integers of shape [G={num_groups}], got {group_sizes.dtype} "
            f"{group_sizes.shape}."
        )
    if lhs.dtype not in SUPPORTED_DTYPES or rhs.dtype != lhs.dtype:
        raise ValueError(
            f"lhs and rhs must both be bfloat16 or both float16, got {lhs.dtype} and "
            f"{rhs.dtype}; cast them first."
        )
    if contraction % config.tile_k or columns % config.tile_n:
        raise ValueError(
            f"K={contraction} must be a multiple of tile_k={config.tile_k} and N={columns} of "
            f"tile_n={config.tile_n}; choose a config whose tiles divide them."
        )
    steps = contraction // config.tile_k
    if config.overlap_tiles and steps % min(config.max_concurrent_steps, steps):
        raise ValueError(
            f"overlap_tiles needs max_concurrent_steps={config.max_concurrent_steps} to divide "
            f"the {steps} steps of K={contraction} / tile_k={config.tile_k}; choose another "
            "max_concurrent_steps or overlap_tiles=False."
        )
    if num_rows == 0 or num_groups == 0:
        raise ValueError(f"lhs needs a row and rhs a group, got {lhs.shape} and {rhs.shape}.")
    return num_rows, contraction, columns



@dataclasses.dataclass(frozen=True)
class _Epilogue:
    """What a consumer does with its finished accumulator(s).

    kind: "store" writes the product; "glu" multiplies the gate and up columns of rhs into two
        accumulators and writes both (bf16) and activation(gate, up); "glu_grad" reads the saved
        gate and up tiles and writes the activation's VJP applied to the product.
    activation: the float32 elementwise `act(gate, up)` of the "glu" kinds.
    """

    kind: str = "store"
    activation: Activation | None = None

    @property
    def accumulators(self) -> int:
        return 2 if self.kind == "glu" else 1


def _kernel_body(
    table_gmem, count_gmem, lhs_gmem, rhs_gmem, *refs, config, transpose_rhs, contraction,
    epilogue,
):
    """One persistent program: the producer loads, the two consumers multiply and store.

    table_gmem: [3, W] int32 and count_gmem: [1] int32 from `work_table`; lhs_gmem: [M, K];
    rhs_gmem: [G, K, N'] or [G, N', K]. refs by `epilogue.kind`, with N the tile loop's width:
    "store": out_gmem [M, N] (N' = N); "glu": gate_up_gmem [M, 2N] and out_gmem [M, N], both
    written (N' = 2N, gate columns first); "glu_grad": gate_up_gmem [M, 2N] read and
    out_gmem [M, 2N] written, the cotangent of gate_up (N' = N).
    """
    if epilogue.kind == "store":
        (out_gmem,) = refs
        gate_up_gmem = None
        columns = out_gmem.shape[1]
    else:
        gate_up_gmem, out_gmem = refs
        columns = gate_up_gmem.shape[1] // 2
    dtype = lhs_gmem.dtype
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    rows_per_consumer = tile_m // COMPUTE_WARPGROUPS
    column_blocks = columns // tile_n
    operand_transforms = swizzled(tile_k, dtype)

    def pipeline(row_block, column_block, body, compute_context, pipeline_state=None):
        # The "glu" kind's second rhs tile is the up columns, column_blocks tiles further.
        rhs_blocks = [column_block + half * column_blocks for half in range(epilogue.accumulators)]
        rhs_specs = [
            plgpu.BlockSpec(
                (tile_n, tile_k), lambda step, b=block: (b, step), transforms=operand_transforms
            )
            if transpose_rhs
            else plgpu.BlockSpec(
                (tile_k, tile_n), lambda step, b=block: (step, b), transforms=operand_transforms
            )
            for block in rhs_blocks
        ]
        lhs_spec = plgpu.BlockSpec(
            (tile_m, tile_k), lambda step: (row_block, step), transforms=operand_transforms
        )
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(contraction // tile_k,),
            memory_registers=PRODUCER_REGISTERS,
            in_specs=[lhs_spec, *rhs_specs],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WARPGROUPS,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
            pipeline_state=pipeline_state,
        )

    def gate_up_halves(column_block):
        """The gate and the up columns of a tile in a [M, 2N] array."""
        return [pl.ds(column_block * tile_n + half * columns, tile_n) for half in (0, 1)]

    def destinations(column_block):
        """The tile's columns of each output, in the order `_epilogue_values` gives values."""
        own_columns = out_gmem.at[:, pl.ds(column_block * tile_n, tile_n)]
        if epilogue.kind == "store":
            return [own_columns]
        if epilogue.kind == "glu":
            return [gate_up_gmem.at[:, half] for half in gate_up_halves(column_block)] + [
                own_columns
            ]
        return [out_gmem.at[:, half] for half in gate_up_halves(column_block)]

    def pipeline_operands(group):
        return (lhs_gmem, *[rhs_gmem.at[group]] * epilogue.accumulators)

    epilogue_n = config.epilogue_tile_n
    allocations = pipeline(0, 0, no_op_body, no_op_body).get_allocations(*pipeline_operands(0))
    scratch = dict(
        pipeline_allocs=allocations,
        swizzled_smem=plgpu.SMEM(
            (COMPUTE_WARPGROUPS, 2, rows_per_consumer, epilogue_n),
            dtype,
            transforms=swizzled(epilogue_n, dtype),
        ),
        plain_smem=plgpu.SMEM(
            (COMPUTE_WARPGROUPS, rows_per_consumer, TMA_ALIGNMENT // jnp.dtype(dtype).itemsize),
            dtype,
        ),
    )
    if epilogue.kind == "glu_grad":
        # Each consumer's gate and up tiles, loaded while its pipeline runs.
        scratch["residual_smem"] = plgpu.SMEM(
            (COMPUTE_WARPGROUPS, 2, rows_per_consumer, tile_n),
            dtype,
            transforms=swizzled(tile_n, dtype),
        )
        scratch["residual_barriers"] = plgpu.Barrier(
            num_arrivals=1, num_barriers=2 * COMPUTE_WARPGROUPS
        )

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(pipeline_allocs, swizzled_smem, plain_smem, residual_smem=None,
               residual_barriers=None):
        consumer = lax.axis_index("wg")
        work_count = count_gmem[0]

        @plgpu.nd_loop((work_count * column_blocks,), collective_axes="sm")
        def _tile_loop(loop_info: plgpu.NDLoopInfo):
            work, column_block = plgpu.planar_snake(
                loop_info.index[0], (work_count, column_blocks), 1, config.grid_tile_width
            )
            group = table_gmem[0, work]
            row_start = table_gmem[1, work]
            row_end = table_gmem[2, work]
            row_block = lax.div(row_start, jnp.int32(tile_m))
            first_row = row_block * tile_m + consumer * rows_per_consumer
            start = jnp.clip(row_start - first_row, 0, rows_per_consumer)
            end = jnp.clip(row_end - first_row, 0, rows_per_consumer)
            own_rows = pl.ds(first_row, rows_per_consumer)
            halves = gate_up_halves(column_block)

            def multiply(_, lhs_smem, *rhs_smem_and_accs):
                *rhs_smems, accs = rhs_smem_and_accs
                own_lhs = lhs_smem.at[pl.ds(consumer * rows_per_consumer, rows_per_consumer)]
                for rhs_smem, acc_ref in zip(rhs_smems, accs):
                    plgpu.wgmma(
                        acc_ref, own_lhs, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem
                    )
                # Each stage is released as soon as its wgmma is done, not a step later
                # (delay_release=1): the last stage of a tile would then still be read while the
                # producer refills it for the next tile. The tensor cores stay busy anyway:
                # while one consumer waits, the other's wgmma runs.
                plgpu.wgmma_wait(0)
                return accs

            def load_residuals():
                for half in (0, 1):
                    plgpu.copy_gmem_to_smem(
                        gate_up_gmem.at[own_rows, halves[half]],
                        residual_smem.at[consumer, half],
                        residual_barriers.at[2 * consumer + half],
                    )

            def wait_residuals():
                for half in (0, 1):
                    plgpu.barrier_wait(residual_barriers.at[2 * consumer + half])

            def consume(run_pipeline):
                @functools.partial(
                    pl.run_scoped,
                    accs=[plgpu.ACC((rows_per_consumer, tile_n), jnp.float32)]
                    * epilogue.accumulators,
                )
                def _accumulate(accs):
                    has_rows = start < end
                    if epilogue.kind == "glu_grad":
                        pl.when(has_rows)(load_residuals)
                    run_pipeline(tuple(accs))
                    if epilogue.kind == "glu_grad":
                        pl.when(has_rows)(wait_residuals)
                    prepare = _epilogue_values(
                        epilogue,
                        [acc_ref[...] for acc_ref in accs],
                        None if residual_smem is None else residual_smem.at[consumer],
                        dtype,
                    )
                    _store_consumer_rows(
                        prepare,
                        destinations(column_block),
                        swizzled_smem.at[consumer],
                        plain_smem.at[consumer],
                        first_row=first_row,
                        start=start,
                        end=end,
                    )

            pipeline(
                row_block,
                column_block,
                multiply,
                consume,
                _pipeline_state(loop_info) if config.overlap_tiles else None,
            )(*pipeline_operands(group), allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _epilogue_values(epilogue, accs, residual_smem, dtype):
    """prepare() -> values, with values(chunk) -> the [R, chunk] value of each of a consumer's
    outputs; prepare runs where the values are stored (it reads SMEM that only consumers owning
    rows of the tile have loaded).

    accs: its [R, tile_n] float32 accumulators; residual_smem: [2, R, tile_n] its gate and up
    tiles ("glu_grad" only). Each output value is cast to dtype once; the activation and its VJP
    see the bf16-rounded operands, exactly what the unfused GMM -> fused_glu pair computes.
    """
    if epilogue.kind == "store":
        out = accs[0].astype(dtype)
        return lambda: lambda chunk: [out[:, chunk]]
    if epilogue.kind == "glu":
        gate, up = (acc.astype(dtype) for acc in accs)

        def glu_values(chunk):
            gate_chunk, up_chunk = gate[:, chunk], up[:, chunk]
            act = epilogue.activation(gate_chunk.astype(jnp.float32), up_chunk.astype(jnp.float32))
            return [gate_chunk, up_chunk, act.astype(dtype)]

        return lambda: glu_values
    out_grad = accs[0].astype(dtype).astype(jnp.float32)

    def prepare():
        # Whole tiles read once: a swizzled tile cannot be sliced narrower than its 64-column
        # swizzle rows.
        gate_tile, up_tile = residual_smem[0], residual_smem[1]

        def glu_grad_values(chunk):
            gate = gate_tile[:, chunk].astype(jnp.float32)
            up = up_tile[:, chunk].astype(jnp.float32)
            grads = _activation_vjp(epilogue.activation, gate, up, out_grad[:, chunk])
            return [grad.astype(dtype) for grad in grads]

        return glu_grad_values

    return prepare


def _pipeline_state(loop_info: plgpu.NDLoopInfo) -> jax.Array:
    """START on a program's first tile, STOP on its last, STEADY between.

    In STEADY and STOP the producer issues a tile's first loads as soon as their buffers are
    consumed, during the previous tile's last steps and epilogue, instead of waiting for the whole
    previous tile. A program with a single tile runs it as START, which skips only the producer's
    final wait for the consumers' last releases: nothing reuses those buffers after it.
    """
    last = loop_info.local_index == loop_info.num_local_steps - 1
    state = jnp.where(last, int(plgpu.PipelinePipeline.STOP), int(plgpu.PipelinePipeline.STEADY))
    return jnp.where(loop_info.local_index == 0, int(plgpu.PipelinePipeline.START), state)


# Primitives of `jax.vjp`'s pullbacks that Mosaic GPU does not lower, as ones that it does
# (one_minus_square as XLA lowers it, for the same float32 result).
_PULLBACK_REWRITES = {
    "add_any": lax.add,
    "one_minus_square": lambda x: (1 + x) * (1 - x),
}


def _activation_vjp(activation, gate, up, out_grad):
    """(d_gate, d_up): `jax.vjp(activation, gate, up)`'s pullback of out_grad, lowerable.

    The pullback is traced to a jaxpr and replayed with `_PULLBACK_REWRITES` applied and nested
    jits inlined, so the activation's derivative is still derived by JAX, in one place.
    """

    def pullback(gate, up, out_grad):
        return jax.vjp(activation, gate, up)[1](out_grad)

    args = (gate, up, out_grad)
    closed = jax.make_jaxpr(pullback)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
    return _replay_rewritten(closed.jaxpr, closed.consts, *args)


def _replay_rewritten(jaxpr, consts, *args):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

    def read(atom):
        return atom.val if isinstance(atom, jax.extend.core.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        inputs = [read(atom) for atom in eqn.invars]
        if eqn.primitive.name in _PULLBACK_REWRITES:
            outputs = [_PULLBACK_REWRITES[eqn.primitive.name](*inputs)]
        elif eqn.primitive.name in ("jit", "pjit"):
            inner = eqn.params["jaxpr"]
            outputs = _replay_rewritten(inner.jaxpr, inner.consts, *inputs)
        else:
            result = eqn.primitive.bind(*inputs, **eqn.params)
            outputs = result if eqn.primitive.multiple_results else [result]
        env.update(zip(eqn.outvars, outputs))
    return [read(atom) for atom in jaxpr.outvars]


def _store_consumer_rows(prepare, destinations, swizzled_smem, plain_smem, *, first_row, start,
                         end):
    """Stores rows [start, end) of one consumer's slabs to rows first_row + [start, end).

    prepare() -> values, run once where rows are stored; values(chunk) -> [R, len(chunk)] values,
    one for each of `destinations` [M, C] (the tile's columns of each output; R = rows a consumer
    owns), computed a column chunk at a time so that an activation's intermediates stay a chunk
    wide; swizzled_smem: [2, R, E] double-buffered epilogue tiles; plain_smem: [R, P] an
    unswizzled one.
    """
    rows = swizzled_smem.shape[1]
    columns = destinations[0].shape[1]
    # The previous tile's stores must have read the SMEM this tile's epilogue overwrites.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when((start == 0) & (end == rows))
    def _whole_slab():
        store_slab(prepare(), destinations, swizzled_smem, first_row)

    @pl.when((start < end) & ((start > 0) | (end < rows)))
    def _cut_slab():
        values = prepare()
        for chunk in column_chunks(columns, plain_smem.shape[-1]):
            for value, destination in zip(values(chunk), destinations):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plain_smem[...] = value
                plgpu.commit_smem()
                _store_row_range(plain_smem, destination.at[:, chunk], first_row, start,
                                 end - start)



def _store_row_range(src_smem, dst_gmem, first_row, start, count):
    """TMA-stores src_smem rows [start, start + count) to dst_gmem rows first_row + the same.

    TMA boxes have static shapes, so the dynamic count is stored as its binary digits: one
    conditional store of 2^i rows for each bit i that is set, the widest first. A TMA copy's SMEM
    address must be 128-byte aligned, so src_smem's rows must be a multiple of 128 bytes.
    """
    size = 1 << (src_smem.shape[0].bit_length() - 1)
    while size:
        @pl.when(count & size != 0)
        def _store(size=size, start=start):
            plgpu.copy_smem_to_gmem(
                src_smem.at[pl.ds(start, size)], dst_gmem.at[pl.ds(first_row + start, size)]
            )

        start = start + (count & size)
        size //= 2

