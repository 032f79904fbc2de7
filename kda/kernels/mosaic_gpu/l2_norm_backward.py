"""The L2 norm's backward for q and k in one pass: a Pallas Mosaic GPU kernel (Hopper).

`l2_norm_vjp_kernel` computes what `kda.common.prepare_qk_vjp` computes for one of q and k with
`use_qk_l2norm` and one value head per q/k head: per row x [K] (a token and head) with cotangent
dy [K] of `l2_normalize(x)` (times the scale, for q),

    dy <- scale dy,   r = rsqrt(sum(x^2) + eps),   dx = r dy - x r^3 sum(x dy).

XLA runs `prepare_qk_vjp` as two passes a tensor, a reduction (both sums) and the elementwise
pass, so it reads the float32 dy twice. Here each program reads its rows of x (bf16) and dy
(float32) once and writes dx (bf16) once: 8 bytes an element instead of 14 (12 of the two passes'
reads, 2 written), so a memory-bound pass takes about 60% of the time (the timings:
`benchmarks/kda_notes.md`).

Layout: [B, T, H, K] is [B, T H, K] rows (a free reshape), and so is dy's [B, T', H, K]: row
t H + h is the same token and head in both while t < T, so dy's padded tokens (T' > T) need no
slicing. One program (one warpgroup) per block of 64 rows of a batch row (`BLOCK`): x and dy by
TMA into swizzled SMEM, into registers (WGMMA layout), the sums along the rows (a row is held by
four threads of one warp: no cross-warp reduction, so no reduction scratch), dx rounded into x's
buffer and stored by TMA. TMA zero-fills a block's rows past the end of x on the load and drops
them on the store (dy has those rows; zero rows give finite values). TMA addresses rows in the
swizzled tiles' 8 and a block must fit its array, so a batch row of fewer than 64 rows, or of
T H not a multiple of 8, takes zero tokens appended to x in XLA first (only then are x and dx
copied).

Numerics: as `prepare_qk_vjp`, float32 with one rounding of dx (dy scaled first: exact for k's
1.0). The sums run in another order than XLA's, so dx can differ by a bf16 ulp near a rounding
boundary (more only where the two terms cancel); rsqrt is approximate (a few float32 ulp).

SMEM per program: x's buffer (bf16 [64, K], then dx), dy's (float32 [64, K]) and two barriers,
49,168 bytes at K = 128 and 24,592 at 64, so by SMEM four programs (nine at K = 64) fit an SM's
228 KiB (1 KiB reserved a program) and one's loads overlap another's math and stores. Registers
may allow fewer: x and dy in float32 are 128 registers a thread at K = 128, four programs' budget.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.common import L2_NORM_EPS
from kda.kernels.mosaic_gpu.common import (OPERAND_DTYPE, SUPPORTED_DIMS, kernel_body,
                                           lowered_once, swizzled_smem)
from kda.kernels.mosaic_gpu.tiles import ROW_SUMS_COMPILER_PARAMS, WGMMA, per_row

BLOCK = 64  # rows a program: float32 [64, 128] is 64 registers a thread
ROW_TILE = 8  # the swizzled tiles' rows: TMA needs an array's rows in whole tiles


def _l2_norm_vjp_kernel(x_gmem, d_y_gmem, d_x_gmem, *, scale):
    """The body of one (batch row, block of rows) program; see the module docstring.

    GMEM: x [B, R, K] bf16 (R: the T H rows, with any zero tokens appended, a multiple of 8 and
    at least 64), d_y [B, R', K] float32 (R' = T' H >= R rounded up to 64), d_x [B, R, K] bf16.
    """
    batch, block = lax.axis_index("batch"), lax.axis_index("blocks")
    rows = pl.ds(block * BLOCK, BLOCK)

    def body(x_smem, d_y_smem, barriers):
        plgpu.copy_gmem_to_smem(x_gmem.at[batch, rows], x_smem, barriers.at[0])
        plgpu.copy_gmem_to_smem(d_y_gmem.at[batch, rows], d_y_smem, barriers.at[1])
        plgpu.barrier_wait(barriers.at[0])
        x = plgpu.load(x_smem, layout=WGMMA).astype(jnp.float32)
        plgpu.barrier_wait(barriers.at[1])
        d_y = plgpu.load(d_y_smem, layout=WGMMA) * scale
        inverse_norm = lax.rsqrt(jnp.sum(x * x, axis=1) + L2_NORM_EPS)
        dot = jnp.sum(x * d_y, axis=1)
        d_x = (per_row(inverse_norm, x.shape) * d_y
               - x * per_row(inverse_norm * inverse_norm * inverse_norm * dot, x.shape))
        plgpu.commit_smem()  # every thread has read x before dx overwrites it
        x_smem[...] = d_x.astype(x_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, d_x_gmem.at[batch, rows])
        plgpu.wait_smem_to_gmem(0)

    key_dim = x_gmem.shape[-1]
    pl.run_scoped(body, swizzled_smem((BLOCK, key_dim), OPERAND_DTYPE),
                  swizzled_smem((BLOCK, key_dim), jnp.float32), plgpu.Barrier(num_barriers=2))


@lowered_once("scale")
def l2_norm_vjp_kernel(x, d_y, *, scale):
    """The cotangent of x through `scale * l2_normalize(x)` (`kda.common.prepare_qk_vjp`'s, for
    one of q and k with `use_qk_l2norm` and HV = H), in one pass.

    Args:
      x: bf16 [B, T, H, K], K in {64, 128}.
      d_y: float32 [B, T', H, K], the cotangent of the normalised (and scaled) x; T' >= T a
        multiple of 64, only the first T tokens read.
      scale: the factor q was multiplied by after its norm (1.0 for k), a Python float.
    Returns:
      bf16 [B, T, H, K].
    """
    batch, length, num_heads, key_dim = x.shape
    padded_length = d_y.shape[1]
    if x.dtype != OPERAND_DTYPE or key_dim not in SUPPORTED_DIMS:
        raise ValueError(f"x must be bf16 with K in {SUPPORTED_DIMS}, got {x.dtype}, K={key_dim}")
    if (d_y.dtype != jnp.float32 or (d_y.shape[0], *d_y.shape[2:]) != (batch, num_heads, key_dim)
            or padded_length < length or padded_length % BLOCK):
        raise ValueError(f"d_y must be float32 [B, T', H, K] (T' >= T a multiple of {BLOCK}) for "
                         f"x {x.shape}, got {d_y.dtype} {d_y.shape}")
    # TMA addresses rows in tiles of 8, and a block's slice must fit its array: other row counts
    # take zero tokens up to the next that works (<= T', a multiple of 64).
    step = ROW_TILE // math.gcd(num_heads, ROW_TILE)
    addressable_length = -(-max(length, -(-BLOCK // num_heads)) // step) * step
    rows_x = jnp.pad(x, ((0, 0), (0, addressable_length - length), (0, 0), (0, 0))).reshape(
        batch, -1, key_dim)
    num_rows = rows_x.shape[1]
    run = plgpu.kernel(
        kernel_body(_l2_norm_vjp_kernel, scale=scale),
        out_type=jax.ShapeDtypeStruct(rows_x.shape, x.dtype),
        grid=(batch, -(-num_rows // BLOCK)),
        grid_names=("batch", "blocks"),
        compiler_params=ROW_SUMS_COMPILER_PARAMS,
    )
    d_x = run(rows_x, d_y.reshape(batch, -1, key_dim))
    return d_x.reshape(batch, -1, num_heads, key_dim)[:, :length]
