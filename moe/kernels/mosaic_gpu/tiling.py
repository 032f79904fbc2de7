"""Tile settings of the MoE's Mosaic GPU grouped GEMMs, their sweep tables and the Hopper
constants both kernels are built around.

A program runs COMPUTE_WARPGROUPS consumer warpgroups (each owning WGMMA_ROWS-row slabs of a
tile: the m64nNk16 wgmma) and one producer warpgroup that only issues TMA loads. A config's SMEM
use is its pipeline stages (tile_m x tile_k lhs + tile_k x tile_n rhs a stage, bf16) plus the
epilogue tiles; each default is sized to fit the 227 KiB a Hopper program may use.

* `RaggedMatmulConfig` (`ragged_matmul`, `ragged_matmul_glu`, `ragged_matmul_glu_grad`):
  `DEFAULT_CONFIG`, `SWEEP_CONFIGS`, `GLU_CONFIG`; `config_for` / `glu_config_for` pick the
  tiles for a product's K and N.
* `TransposedRaggedMatmulConfig` (`transposed_ragged_matmul`): `TRANSPOSED_DEFAULT_CONFIG`,
  `TRANSPOSED_SWEEP_CONFIGS`, `transposed_config_for`.

The sweep tables are what `experiments.bench_grouped_matmul` times
(`benchmarks/grouped_matmul_h200.md`); every entry lowers for Hopper at the benchmark shapes.
"""

import dataclasses

import jax.numpy as jnp

COMPUTE_WARPGROUPS = 2  # consumers; the producer warpgroup is one more
PRODUCER_REGISTERS = 40  # the producer only issues TMA; the consumers share the rest
WGMMA_ROWS = 64
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
TMA_ALIGNMENT = 128  # bytes: a TMA copy's SMEM address, hence the cut-slab rows
HOPPER_SMS = 132  # H100 / H200 SXM SMs, used when no device or abstract mesh says otherwise


def _check_epilogue_and_stages(config) -> None:
    """The checks both kernels' configs share: epilogue tiles that divide tile_n, and at least
    two pipeline stages."""
    if config.tile_n % config.epilogue_tile_n or config.epilogue_tile_n % 8:
        raise ValueError(
            f"epilogue_tile_n must be a multiple of 8 dividing tile_n={config.tile_n}, "
            f"got {config.epilogue_tile_n}."
        )
    if config.max_concurrent_steps < 2:
        raise ValueError(
            "max_concurrent_steps must be at least 2 (loads overlap the math), "
            f"got {config.max_concurrent_steps}."
        )


@dataclasses.dataclass(frozen=True)
class RaggedMatmulConfig:
    """Tile settings of `ragged_matmul`.

    tile_m: output rows a program computes at a time, split between the two consumer warpgroups
        (tile_m / 2 each, a multiple of 64).
    tile_n: output columns a program computes at a time (each consumer takes all of them).
    tile_k: contraction width of one pipeline stage (64 bf16 = one 128-byte swizzle row).
    max_concurrent_steps: pipeline stages in flight (SMEM buffers per operand).
    epilogue_tile_n: columns of each swizzled SMEM tile the epilogue stores whole slabs through
        (slabs cut by a group boundary go through a plain tile of 128-byte rows).
    grid_tile_width: column blocks visited before the next row block (a band of this many column
        blocks sweeps the row blocks, so a group's rhs band stays in L2 while its rows stream).
    overlap_tiles: whether the producer starts loading a program's next tile while the current
        one finishes (a pipeline of pipelines); needs max_concurrent_steps to divide K / tile_k.
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    max_concurrent_steps: int = 4
    epilogue_tile_n: int = 32
    grid_tile_width: int = 8
    overlap_tiles: bool = True

    def __post_init__(self):
        if self.tile_m % (COMPUTE_WARPGROUPS * WGMMA_ROWS):
            raise ValueError(
                f"tile_m must be a multiple of {COMPUTE_WARPGROUPS * WGMMA_ROWS} (two warpgroups "
                f"of whole 64-row wgmma tiles), got {self.tile_m}."
            )
        if not 64 <= self.tile_n <= 256 or self.tile_n % 64:
            raise ValueError(
                f"tile_n must be a multiple of 64 (128-byte rows for the cut-slab stores) up to "
                f"256 (wgmma), got {self.tile_n}."
            )
        if self.tile_k % 64:
            raise ValueError(
                f"tile_k must be a multiple of 64 (128-byte swizzle), got {self.tile_k}."
            )
        _check_epilogue_and_stages(self)
        if self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width must be positive, got {self.grid_tile_width}.")


# Shared memory of the default: 4 stages of 128x64 + 64x256 bf16 (192 KiB), the double-buffered
# 32-column epilogue tiles (16 KiB) and the cut-slab tiles (16 KiB): 224 of the 227 KiB a program
# may use on Hopper, so a 64-column epilogue needs fewer stages or a narrower tile.
DEFAULT_CONFIG = RaggedMatmulConfig()
# Alternatives for a sweep (each lowers for Hopper at the benchmark shapes: see the tests).
SWEEP_CONFIGS = {
    "128x256 k64 s4 e32": DEFAULT_CONFIG,
    "128x256 k64 s4 e32 no-overlap": RaggedMatmulConfig(overlap_tiles=False),
    "128x256 k128 s2 e32": RaggedMatmulConfig(tile_k=128, max_concurrent_steps=2),
    "128x128 k64 s4 e64": RaggedMatmulConfig(tile_n=128, epilogue_tile_n=64),
}


# The GLU variants: tile_n = 128 output columns, i.e. 128 gate and 128 up columns of rhs, so the
# two accumulators a consumer holds are the default's one 64x256 (128 registers a thread), and a
# stage's rhs tiles the default's one (224 KiB of SMEM as the default). "glu_grad" holds one
# 64x128 accumulator but adds each consumer's gate and up tiles (64 KiB): 224 KiB too.
GLU_CONFIG = RaggedMatmulConfig(tile_n=128, epilogue_tile_n=32)


def config_for(contraction: int, columns: int) -> RaggedMatmulConfig:
    """The tiles for a product of contraction width K and output width N: the default (the
    fastest of the sweep at the MoE's widths, `benchmarks/grouped_matmul_h200.md`) where they
    divide, else 128-column tiles (N % 256 != 0) and no tile overlap (K / 64 steps not a multiple
    of 4). K must be a multiple of 64 and N of 128."""
    config = DEFAULT_CONFIG
    if columns % config.tile_n:
        config = SWEEP_CONFIGS["128x128 k64 s4 e64"]
    return _without_overlap_unless_it_fits(config, contraction)


def glu_config_for(contraction: int) -> RaggedMatmulConfig:
    """The tiles of the GLU variants at contraction width K (a multiple of 64): GLU_CONFIG,
    without tile overlap where K / 64 steps are not a multiple of its 4 stages."""
    return _without_overlap_unless_it_fits(GLU_CONFIG, contraction)


def _without_overlap_unless_it_fits(config, contraction):
    """`config`, with overlap_tiles off unless its stages divide the K / tile_k steps."""
    if (contraction // config.tile_k) % config.max_concurrent_steps:
        return dataclasses.replace(config, overlap_tiles=False)
    return config


# The weight gradient: out[g] = lhs[rows of g]^T @ out_grad[rows of g], a reduction over each
# group's rows (ragged in its contraction, where `ragged_matmul` is ragged in its output rows).


@dataclasses.dataclass(frozen=True)
class TransposedRaggedMatmulConfig:
    """Tile settings of `transposed_ragged_matmul`.

    An output tile is TRANSPOSED_TILE_K rows of K (64 a consumer: one wgmma's rows) by tile_n
    columns of N; each pipeline stage loads tile_rows rows of lhs and out_grad.

    tile_n: output columns a program computes at a time (each consumer takes all of them; each
        zeroes half of them in a step's out_grad tile, so 128 or 256: whole 64-column swizzle
        rows a half).
    tile_rows: rows of the reduction a pipeline stage loads (a multiple of 64).
    max_concurrent_steps: pipeline stages in flight (SMEM buffers per operand).
    epilogue_tile_n: columns of each swizzled SMEM tile the output is stored through.
    """

    tile_n: int = 256
    tile_rows: int = 64
    max_concurrent_steps: int = 4
    epilogue_tile_n: int = 32

    def __post_init__(self):
        if self.tile_n not in (128, 256):
            raise ValueError(
                f"tile_n must be 128 or 256 (wgmma width; halves of whole 64-column swizzle "
                f"rows), got {self.tile_n}."
            )
        if self.tile_rows % 64 or self.tile_rows <= 0:
            raise ValueError(
                f"tile_rows must be a positive multiple of 64 (128-byte swizzle), got "
                f"{self.tile_rows}."
            )
        _check_epilogue_and_stages(self)


TRANSPOSED_TILE_K = COMPUTE_WARPGROUPS * WGMMA_ROWS  # output rows of K a tile has
# Shared memory of the default: 4 stages of 64x128 lhs + 64x256 out_grad bf16 (192 KiB) and the
# double-buffered 32-column epilogue tiles (16 KiB).
TRANSPOSED_DEFAULT_CONFIG = TransposedRaggedMatmulConfig()
# Alternatives for a sweep (each lowers for Hopper at the benchmark shapes: see the tests).
TRANSPOSED_SWEEP_CONFIGS = {
    "128x256 r64 s4 e32": TRANSPOSED_DEFAULT_CONFIG,
    "128x256 r128 s2 e32": TransposedRaggedMatmulConfig(tile_rows=128, max_concurrent_steps=2),
    "128x128 r64 s6 e64": TransposedRaggedMatmulConfig(
        tile_n=128, max_concurrent_steps=6, epilogue_tile_n=64
    ),
}


def transposed_config_for(columns: int) -> TransposedRaggedMatmulConfig:
    """The tiles for an output width N (a multiple of 128): the default where its 256 columns
    divide N, else its 128-column alternative."""
    if columns % TRANSPOSED_DEFAULT_CONFIG.tile_n:
        return TRANSPOSED_SWEEP_CONFIGS["128x128 r64 s6 e64"]
    return TRANSPOSED_DEFAULT_CONFIG
