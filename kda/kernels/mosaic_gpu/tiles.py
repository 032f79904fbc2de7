"""Building blocks of the Mosaic GPU chunk-preparation kernels (forward and backward, Hopper).

`kda.kernels.mosaic_gpu.prepare`, `kda.kernels.mosaic_gpu.prepare_backward` and
`kda.kernels.mosaic_gpu.score_backward` build their kernel bodies from these. Everything but the
last two functions runs inside a kernel body: one warpgroup under `COMPILER_PARAMS` (Lane
semantics), register values float32 in the WGMMA layout (rows r = tokens of the chunk), wgmma
operands bf16: right ones in SMEM, left ones in SMEM or, where computed in registers, there.
Shapes use C = 64 (the chunk) and n (key columns: K in the forward, a 32-column slab in the
backward's score kernel).

* Layout helpers: `per_row`, `per_column`, `iota`, `load_plain`.
* Exact bf16 splits and the products of their parts: `split_bf16`, `store_split`, `matmul`,
  `matmul_of_splits`.
* The chunk cumulative sum as a triangular wgmma: `store_lower_ones`, `cumulative_sum`; or, over
  128 columns, as a compensated scan with one thread a column: `scanned_cumulative_sum`.
* The causal anchors `b_i = G[16 i] + 7.5 L` of the score tiles: `anchor`, `row_anchors`,
  `exponent_up_to_tile`, `exponent_from_tile`, and the transposed score tiles `transposed_scores`
  (the module docstring of `kda.kernels.mosaic_gpu.prepare` explains the anchors); they read the
  anchors from G's SMEM, or from `StoredAnchors` (`store_anchors`) once G's SMEM holds other data.
* Packed documents: `state_masks` and `same_document` in the kernel, from the index
  `documents_in_chunk` makes.
* The UT transform's inverse `(I + N)^-1`: `unit_lower_inverse`.
* Plain JAX around the kernels: `documents_in_chunk`, `pad_to_chunks`.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.chunked import CHUNK_SIZE, TILE_SIZE
from kda.common import document_starts
from kda.kernels.mosaic_gpu.common import OPERAND_DTYPE

CHUNK = CHUNK_SIZE
NUM_TILES = CHUNK // TILE_SIZE
WARPGROUP_THREADS = 128
WGMMA = plgpu.Layout.WGMMA
ROW_VECTOR = WGMMA.reduce(1)  # a [rows] vector of a WGMMA-layout matrix
COLUMN_VECTOR = WGMMA.reduce(0)  # a [columns] vector of a WGMMA-layout matrix
# Lane semantics: the blocks name their register layouts (WGMMA and its vectors). approx_math:
# exp and rsqrt on the MUFU unit (a few float32 ulp), fine ahead of bf16 operands.
COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True,
                                       lowering_semantics=plgpu.LoweringSemantics.Lane)
# For kernels whose only sums are along rows (within a warp): the 2 KiB of cross-warp reduction
# scratch would be waste.
ROW_SUMS_COMPILER_PARAMS = dataclasses.replace(COMPILER_PARAMS, reduction_scratch_bytes=0)


def per_row(vector, shape):
    """A ROW_VECTOR [shape[0]] repeated along the columns: [shape[0], shape[1]]."""
    return lax.broadcast_in_dim(vector, shape, (0,))


def per_column(vector, shape):
    """A COLUMN_VECTOR [shape[1]] repeated down the rows: [shape[0], shape[1]]."""
    return lax.broadcast_in_dim(vector, shape, (1,))


def iota(shape, dimension):
    """int32 [shape] (WGMMA layout): each element's index along `dimension`."""
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=WGMMA)


def load_plain(smem):
    """float32 [C, n] from plain (untiled) row-major SMEM, into the WGMMA layout.

    The plain layout lets single rows be read (`anchor`), at the price of bank conflicts on
    whole-tile loads.
    """
    return plgpu.load(smem, layout=WGMMA, optimized=False)


def split_bf16(x, parts):
    """float32 x -> `parts` bf16 arrays that sum to x (to float32 precision for three)."""
    pieces = []
    for _ in range(parts - 1):
        pieces.append(x.astype(OPERAND_DTYPE))
        x = x - pieces[-1].astype(jnp.float32)
    return (*pieces, x.astype(OPERAND_DTYPE))


def store_split(parts, x):
    """Stores the `len(parts)` bf16 parts of float32 x (`split_bf16`) into the SMEM refs parts."""
    for part, value in zip(parts, split_bf16(x, len(parts))):
        part[...] = value


def matmul_of_splits(a_parts, b_parts, shape):
    """`(sum a_parts) @ (sum b_parts)` by wgmma, without products of two low parts: float32 [shape].

    Args:
      a_parts: bf16 [M, n] operands, the hi part first (one, or a hi/lo pair): SMEM refs (as
        `store_split` leaves them) or WGMMA-layout arrays (`split_bf16`), which wgmma reads from
        registers, so that no store and barrier stand between the value and the product;
        b_parts: bf16 [n, shape[1]] SMEM refs likewise. A product of two lo parts is below 2^-16
        of the hi product and left out.
    """

    def product(acc):
        for i, a in enumerate(a_parts):
            for j, b in enumerate(b_parts):
                if i + j < 2:
                    plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(product, plgpu.ACC(shape))


def matmul(a, b_smem, shape):
    """`a @ b` by one wgmma (a in SMEM or registers, as in `matmul_of_splits`): float32 [shape]."""
    return matmul_of_splits((a,), (b_smem,), shape)


def store_lower_ones(ones):
    """ones[r, s] = 1 for s <= r, else 0 (bf16 [C, C] SMEM): `cumulative_sum`'s triangle."""
    shape = ones.shape
    ones[...] = jnp.where(iota(shape, 1) <= iota(shape, 0), 1.0, 0.0).astype(OPERAND_DTYPE)


def cumulative_sum(x, parts, ones, *, reverse=False):
    """`tril(1) @ x` (or with `reverse`, `triu(1) @ x`: the sum from each row to the end).

    x is split exactly into three bf16 parts, so the sum is float32-accurate.

    Args:
      x: float32 [C, n].
      parts: three bf16 [C, n] SMEM operands (overwritten).
      ones: bf16 [C, C] SMEM holding tril(1) (`store_lower_ones`).
    Returns:
      float32 [C, n].
    """
    store_split(parts, x)
    plgpu.commit_smem()
    triangle = ones.transpose((1, 0)) if reverse else ones

    def product(acc):
        for part in parts:
            plgpu.wgmma(acc, triangle, part)
        return acc[...]

    return pl.run_scoped(product, plgpu.ACC(x.shape))


SCAN_SEGMENTS = 4  # independent chains of `scanned_cumulative_sum`


def two_sum(a, b):
    """`(s, e)` with `s = fl(a + b)` and `s + e = a + b` exactly (Knuth's two-sum)."""
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


def scanned_cumulative_sum(x_smem):
    """`cumsum(x)` down the rows of x, in place, by a scan: thread t adds up column t row by row.

    Compensated (each addition's rounding error, exact by `two_sum`, is carried and added back),
    so every sum is float32-accurate, without splits or products. Thread t reads and writes only
    column t, so the rows need no barrier between them.

    The 64 rows are cut into SCAN_SEGMENTS segments whose chains of additions are independent, so
    that they can overlap: a first pass sums each segment, the segments' sums give each one its
    starting (sum, carried error) pair, and a second pass scans every segment from that pair. The
    dependent chain is 2 x 16 additions instead of 63, for twice the loads; the gain is small,
    as the other program on the SM hides most of the chain.

    Rolled loops, not unrolled steps: unrolled, the preparation kernel's straight-line code is
    bound by fetching its instructions, so the scan and the kernels' other long loops are rolled
    (`lax.fori_loop`, `pl.loop`; the numbers are in `benchmarks/kda_notes.md`).

    Args:
      x_smem: float32 [C, 128] plain SMEM: x, then its cumulative sum (committed).
    Returns:
      float32 [C, 128], the cumulative sum in the WGMMA layout.
    """
    if x_smem.shape != (CHUNK, WARPGROUP_THREADS):
        raise ValueError(f"x_smem must be [{CHUNK}, {WARPGROUP_THREADS}] (a column a thread), got "
                         f"{x_smem.shape}; use cumulative_sum for other widths")
    row_layout = plgpu.Layout.WG_STRIDED((1, WARPGROUP_THREADS), 1)  # thread t: column t
    segment_rows = CHUNK // SCAN_SEGMENTS

    def load(row):
        return plgpu.load(x_smem.at[pl.ds(row, 1)], layout=row_layout)

    def add(pair, x):
        """(sum, carried error) + x."""
        total, carried = pair
        total, error = two_sum(total, x)
        return total, carried + error

    def add_rows(store):
        def step(row, pairs):
            pairs = tuple(add(pair, load(segment * segment_rows + row))
                          for segment, pair in enumerate(pairs))
            if store:
                for segment, (total, carried) in enumerate(pairs):
                    x_smem[pl.ds(segment * segment_rows + row, 1)] = total + carried
            return pairs
        return step

    zero = load(0) * 0.0  # (zeros in the rows' layout)
    # The last segment's sum starts nothing: the first pass leaves it out.
    zeros = tuple((zero, zero) for _ in range(SCAN_SEGMENTS - 1))
    segment_sums = lax.fori_loop(0, segment_rows, add_rows(store=False), zeros)
    starts = [(zero, zero)]
    for segment_sum in segment_sums:
        total, error = two_sum(starts[-1][0], segment_sum[0])
        starts.append((total, starts[-1][1] + segment_sum[1] + error))
    lax.fori_loop(0, segment_rows, add_rows(store=True), tuple(starts))
    plgpu.commit_smem()
    return load_plain(x_smem)


class StoredAnchors(NamedTuple):
    """The anchors kept apart from G (`store_anchors`), so that G's SMEM can be reused.

    Every function below that reads anchors from `G_smem` reads them from one of these instead.
    """

    smem: jax.Array  # float32 [NUM_TILES, n] SMEM: row i holds b_i


def anchor(G_smem, tile, lower_bound):
    """The causal anchor `b_tile = G[16 tile] + 7.5 L`: float32 [n] (a COLUMN_VECTOR).

    Read from SMEM when needed rather than kept: each one costs n / 4 registers a thread.

    Args:
      G_smem: float32 [C, n] plain SMEM holding G = cumsum(g) (`load_plain` reads it whole), or
        `StoredAnchors`.
      tile: the 16-row tile, a Python int or traced (a rolled loop's); lower_bound: L, the
        gates' lower bound.
    """
    if isinstance(G_smem, StoredAnchors):
        return plgpu.load(G_smem.smem.at[tile], layout=COLUMN_VECTOR)
    return (plgpu.load(G_smem.at[TILE_SIZE * tile], layout=COLUMN_VECTOR)
            + 0.5 * (TILE_SIZE - 1) * lower_bound)


def store_anchors(anchors_smem, G_smem, lower_bound) -> StoredAnchors:
    """Copies the anchors out of G's SMEM (float32 [C, n]) into anchors_smem [NUM_TILES, n].

    The copy holds the same float32 values `anchor` computes from G_smem.
    """
    for tile in range(NUM_TILES):
        anchors_smem[tile] = anchor(G_smem, tile, lower_bound)
    return StoredAnchors(anchors_smem)


def row_anchors(G_smem, shape, lower_bound):
    """float32 [C, n] (shape): row r holds the anchor of its own tile, `b_(r // 16)`."""
    rows = iota(shape, 0)
    anchors = per_column(anchor(G_smem, NUM_TILES - 1, lower_bound), shape)
    for tile in reversed(range(NUM_TILES - 1)):
        anchors = jnp.where(rows < TILE_SIZE * (tile + 1),
                            per_column(anchor(G_smem, tile, lower_bound), shape), anchors)
    return anchors


def exponent_up_to_tile(G, G_smem, tile, lower_bound):
    """float32 [C, n]: `b_tile - G_s` on rows s < 16 (tile + 1), -inf below.

    exp of it scales the keys s that the rows of the tile see (a score tile's column factor).
    """
    return jnp.where(iota(G.shape, 0) < TILE_SIZE * (tile + 1),
                     per_column(anchor(G_smem, tile, lower_bound), G.shape) - G, -jnp.inf)


def exponent_from_tile(G, G_smem, tile, lower_bound):
    """float32 [C, n]: `G_r - b_tile` on rows r >= 16 tile, -inf above.

    exp of it scales the rows r that see the keys of the tile.
    """
    return jnp.where(iota(G.shape, 0) >= TILE_SIZE * tile,
                     G - per_column(anchor(G_smem, tile, lower_bound), G.shape), -jnp.inf)


def transposed_scores(k, G, G_smem, scaled_rows, lower_bound):
    """Score matrices `A[r, s] = sum_c x_r[c] k_s[c] exp(G_r[c] - G_s[c])`, transposed, by tiles.

    Column tile i of `A^T` (the rows r of row tile i) is `k exp(b_i - G)` times
    `(x exp(G - b_i))[tile i]^T`: wgmma's M = 64 runs over s and N = 16 over the tile, so no
    product is wasted. The column factor is not masked to the keys s < 16 (i + 1) that the tile
    sees: beyond them `exp(b_i - G_s)` may overflow, but only into entries s > r, which the
    caller's causal mask selects away (a select, not a product, so inf and NaN do not leak). The
    mask would cost a compare and a select per element and tile.

    The column factors are wgmma's left operands in registers, each one computed while the
    products of the tile before it run: no factor passes through SMEM, so there is no store and no
    barrier a tile, and fewer registers spill than with the factors staged in SMEM.

    Args:
      k: float32 [C, n], the (normalised) keys.
      G: float32 [C, n], cumsum(g); G_smem holds it too (plain SMEM, for `anchor`).
      scaled_rows: bf16 [C, n] SMEM operands, one per score matrix, each `x exp(G - row_anchors)`.
      lower_bound: L.
    Returns:
      One float32 [C, C] `A^T[s, r]` per scaled_rows; the entries s > r are not meaningful (inf
      or NaN beyond the diagonal tiles): the caller must mask them with a select.
    """

    def column_factor(i):
        return (k * jnp.exp(per_column(anchor(G_smem, i, lower_bound), G.shape)
                            - G)).astype(OPERAND_DTYPE)

    def scores(*accs):
        factor = column_factor(0)
        for i in range(NUM_TILES):
            tile_rows = slice(TILE_SIZE * i, TILE_SIZE * (i + 1))
            for acc, x in zip(accs, scaled_rows):
                plgpu.wgmma(acc.at[:, tile_rows], factor, x.at[tile_rows].transpose((1, 0)))
            if i + 1 < NUM_TILES:
                next_factor = column_factor(i + 1)
                plgpu.wgmma_wait(0)  # tile i's products have read their factor's registers
                factor = next_factor
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(scores, *(plgpu.ACC((CHUNK, CHUNK)) for _ in scaled_rows))


class StateMasks(NamedTuple):
    """Which rows of a chunk of packed documents touch the state (`state_masks`): float32 1/0."""

    reads_state: jax.Array  # [C, n]: the row's document began before the chunk
    writes_state: jax.Array  # [C, n]: the row's document is the chunk's last
    keeps_state: jax.Array  # scalar: no document began inside the chunk


def state_masks(document_smem, shape) -> StateMasks:
    """The state masks of the chunk's documents, [C, n] = shape.

    document_smem: float32 [C] SMEM holding, per token, how many documents began inside the chunk
    up to the token (`documents_in_chunk`). Rows of a document that began inside the chunk do not
    read the entering state, and only the chunk's last document writes the leaving one.
    """
    document_of_row = plgpu.load(document_smem, layout=ROW_VECTOR)
    last_document = document_smem[CHUNK - 1]
    return StateMasks(
        reads_state=per_row(jnp.where(document_of_row == 0.0, 1.0, 0.0), shape),
        writes_state=per_row(jnp.where(document_of_row == last_document, 1.0, 0.0), shape),
        keeps_state=jnp.where(last_document == 0.0, 1.0, 0.0))


def same_document(document_smem):
    """bool [C, C]: tokens r and s of the chunk are in one document (document_smem as above).

    Built where a score matrix is masked rather than with `state_masks`: it takes C^2 / 128
    predicates a thread.
    """
    shape = (CHUNK, CHUNK)
    return (per_row(plgpu.load(document_smem, layout=ROW_VECTOR), shape)
            == per_column(plgpu.load(document_smem, layout=COLUMN_VECTOR), shape))


def unit_lower_inverse(N_smem, scratch):
    """`(I + N)^-1` for strictly lower-triangular N by recursive doubling of the diagonal blocks.

    With `X_b` the inverse of the block-diagonal part of blocks of size b, `X_2b = X_b - X_b C_b
    X_b`, where `C_b` holds the entries of N that link two neighbouring b-blocks. Like block
    forward substitution, every intermediate is a block of the true inverse, so nothing grows the
    way powers of N would (a Neumann-series product is not stable here). The doublings are a
    rolled loop, to keep the kernel's code small (`scanned_cumulative_sum`). The left factor of
    each round's two products stays in registers (wgmma reads it there): only the right ones,
    the link and `X_b`, pass through SMEM, behind one barrier a round.

    Args:
      N_smem: bf16 [C, C] SMEM holding N.
      scratch: two bf16 [C, C] SMEM operands (link, inverse), overwritten.
    Returns:
      float32 [C, C].
    """
    N = plgpu.load(N_smem, layout=WGMMA).astype(jnp.float32)
    link, inverse_smem = scratch
    rows, columns = iota(N.shape, 0), iota(N.shape, 1)
    # Entries with 2^e <= r ^ c < 2^(e + 1) link neighbouring 2^e-blocks of one 2^(e + 1)-block:
    # e = 31 - clz(r ^ c) (-1 on the diagonal), so that each round's mask is one comparison.
    level = 31 - lax.clz(rows ^ columns)

    def double(exponent, inverse):
        link[...] = jnp.where(level == exponent, N, 0.0).astype(OPERAND_DTYPE)
        inverse_operand = inverse.astype(OPERAND_DTYPE)
        inverse_smem[...] = inverse_operand
        plgpu.commit_smem()
        product = matmul(inverse_operand, link, N.shape).astype(OPERAND_DTYPE)
        return inverse - matmul(product, inverse_smem, N.shape)

    inverse = jnp.where(rows == columns, 1.0, 0.0) - jnp.where(level < 1, N, 0.0)
    return lax.fori_loop(1, int(math.log2(CHUNK)), double, inverse)


def documents_in_chunk(segment_ids, batch, padded_length):
    """float32 [B, T']: how many documents began inside the token's chunk up to the token.

    Args:
      segment_ids: int [B, T] or None (one document a row); padded_length: T' >= T, a multiple of
        C (`pad_to_chunks`).
    """
    if segment_ids is None:
        return jnp.zeros((batch, padded_length), jnp.float32)
    starts = document_starts(segment_ids)
    starts = jnp.pad(starts, ((0, 0), (0, padded_length - starts.shape[1])))
    per_chunk = starts.reshape(batch, -1, CHUNK).astype(jnp.int32)
    return jnp.cumsum(per_chunk, axis=-1).reshape(batch, padded_length).astype(jnp.float32)


def pad_to_chunks(x, dtype, padded_length):
    """x [B, T, ...] as dtype, zero tokens appended up to [B, T', ...].

    Zero tokens leave the state untouched (k = v = g = 0); callers crop them from gradients.
    """
    x = x.astype(dtype)
    return jnp.pad(x, [(0, 0), (0, padded_length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
