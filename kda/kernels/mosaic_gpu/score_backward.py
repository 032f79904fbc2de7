"""The score-tile backward of KDA's chunk preparation, [token, key] oriented: Mosaic GPU (Hopper).

The second kernel of `kda.kernels.mosaic_gpu.prepare_backward.prepare_chunks_vjp_kernel`, after
the UT/WY kernel (kernel 1, whose dAkk and dk term it reads): per chunk, the gradients through
both score matrices `A[r, s] = sum_c x_r[c] k_s[c] exp(G_r[c] - G_s[c])` (x = q for Aqk, k for
Akk), the direct terms, dG and its reverse cumulative sum (the formulas: that module's docstring).
The anchor of a term is `b_t = G[16 t] + 7.5 L` of the tile t of the *summed* token:

    row terms    R[r] = sum_t exp(G_r - b_t) (dA[:, tile t] F_t)[r],    F_t = (k exp(b_t - G))[t]
    column terms Q[s] = sum_t exp(b_t - G_s) (dA[tile t, :]^T X_t)[s],  X_t = (x exp(G - b_t))[t]

so every product is [64 tokens, keys] with K = 16 and nothing is transposed back (anchored at the
output's tile, a product would have M = 16 tokens, which wgmma's M = 64 runs only transposed).
`F_t`, `X_t` are the tile-t rows of one [64, keys] array each: two exp tiles, not one per tile.
As in the forward the factors stay within e^(7.5 |L|) <= e^37.5 (rows r < 16 t, whose factor
would overflow, have dA = 0 and are masked); only weights below e^-49 underflow. A pair within
one tile uses one anchor both ways and the operands are hi/lo pairs, so the row and column terms
that cancel in dG round alike.

Grid: one program per (batch row, value head, chunk) of two warpgroups (`warpgroups`), sharing
the staged score cotangents and splitting the keys into 32-column slabs (`SLAB`: a float32
[64, 32] tile is 16 registers a thread). The cumulative sum of k d k_to_state is a triangle
wgmma whose last row is dG's last-row sum (a sum over rows would use the reduction scratch both
warpgroups share). Products go in groups of tiles (`COLUMN_TILES_PER_GROUP`,
`ROW_TILES_PER_GROUP`), each tile's accumulator summed while the group's later products run;
float32 cotangents fold into sums as they are read; most loads run under other work. A slab
takes 5 TMA waits, 7 SMEM commits, 8 full wgmma waits. Slabs and tile groups are rolled loops
(smaller code: `tiles.scanned_cumulative_sum` says why).

Numerics: bf16 operands, float32 accumulation, hi/lo factors; G is the forward's (the values its
score tiles were made with). SMEM: 109 KiB a program at K = 64 and 128 (190 with four
warpgroups); two programs an SM would need at most 128 registers a thread, ptxas takes 255 (128
with four warpgroups), so one program runs an SM either way (timings: `benchmarks/kda_notes.md`).
Buffers are reused in place, not by `plgpu.RefUnion` (interpret mode checks a union's groups as
whole buffers, so two warpgroups' halves of one would race; it does not check wgmma's operand
reads for races).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.chunked import TILE_SIZE
from kda.kernels.mosaic_gpu.common import (OPERAND_DTYPE, kernel_body, lowered_once,
                                           swizzled_smem)
from kda.kernels.mosaic_gpu.tiles import (CHUNK, COLUMN_VECTOR, COMPILER_PARAMS, NUM_TILES,
                                          ROW_VECTOR, WGMMA, cumulative_sum, exponent_from_tile,
                                          exponent_up_to_tile, iota, load_plain, per_column,
                                          per_row, row_anchors, same_document, state_masks,
                                          store_anchors, store_lower_ones, store_split)

WARPGROUPS = 2  # the default; at least two (one masks dAqk while another stores the triangle)
SLAB = 32  # key columns a warpgroup works on at a time
SWIZZLE = 2 * TILE_SIZE  # bytes: 16 bf16 columns, so every 16-token slice is tile aligned

# Rows of the shared table of float32 [C] vectors.
DOCUMENT, Q_FACTOR, K_FACTOR = range(3)
# Rows of each warpgroup's table of float32 [SLAB] vectors: the anchors (rows 0 to NUM_TILES - 1,
# `store_anchors`), then these.
LAST_G, D_CHUNK_DECAY = NUM_TILES, NUM_TILES + 1
# Each warpgroup's four bf16 [C, SLAB] operand tiles: the column terms' hi/lo pairs, then the row
# terms' pair over the first; the cumulative sums' three parts before and after.
Q_COLUMNS, K_COLUMNS, K_ROWS, SUM_PARTS = (0, 1), (2, 3), (0, 1), (0, 1, 2)
OPERAND_TILES = 4
PARTS = 2  # hi and lo: the wgmmas of one operand and one score matrix
# Tiles of column terms (one accumulator each) and of row terms (two each) issued together; each
# tile's accumulators are read once done, while the group's later products run. Small groups keep
# the registers a thread needs low (16 an accumulator): two programs of two warpgroups an SM, or
# one of four, allow 128.
COLUMN_TILES_PER_GROUP, ROW_TILES_PER_GROUP = 2, 1


def tile16_smem(shape):
    """bf16 SMEM in [8, 16] tiles with a 32-byte swizzle: every 16-row or 16-column slice of the
    minor two dimensions is a wgmma operand (K = 16), and all operands share the swizzle."""
    return plgpu.SMEM(shape, OPERAND_DTYPE, transforms=(plgpu.TilingTransform((8, TILE_SIZE)),
                                                        plgpu.SwizzleTransform(SWIZZLE)))


def _score_backward_kernel(q_gmem, k_gmem, G_gmem, document_gmem, q_factor_gmem, k_factor_gmem,
                           daqk_gmem, dakk_gmem, dq_state_gmem, dk_state_gmem, dk_wy_gmem,
                           ddecay_gmem, dq_gmem, dk_gmem, dg_gmem,
                           scores, ones, vectors, slab_vectors, qk, operands, plain,
                           shared_loaded, shared_ready, finished, G_loaded, qk_loaded,
                           dk_state_loaded, dq_state_loaded, late_loaded,
                           *, lower_bound, group, slabs):
    """One (batch row, value head, chunk) program of (usually) two warpgroups.

    GMEM inputs: q, k [B, T, H, K] bf16; the forward's G [B, HV, N, C, K], document [B, T],
    q_factor and k_factor [B, H, T] (inverse norms, q's times the scale) float32; dAqk, dAkk
    [B, HV, N, C, C] bf16; d q_from_state, d k_to_state, kernel 1's dk term [B, HV, N, C, K] and
    d chunk_decay [B, HV, N, K] float32. Outputs dq, dk (of the normalised, scaled q and k), dg
    float32 [B, T, HV, K]. slabs: key slabs per warpgroup (K / (32 warpgroups)).

    Scratch (`score_backward`'s `scratch_types`; the per-warpgroup buffers indexed by the
    warpgroup first): the two score cotangents and the triangle (24 KiB), and per warpgroup q and
    k (8 KiB), four operand tiles (16 KiB) and two float32 tiles, A and B (16 KiB), reused in
    place: A holds G, the cumulative sum of k d k_to_state, kernel 1's dk term and dk; B
    d k_to_state, d q_from_state, dk's column sums, dq and dg; the operand tiles the sums' parts
    and both terms' operands.
    """
    batch, head, chunk = (lax.axis_index(axis) for axis in ("batch", "heads", "chunks"))
    warpgroup = lax.axis_index("warpgroup")
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    out = (batch, head, chunk)
    slab_shape = (CHUNK, SLAB)
    daq, dak = scores.at[0], scores.at[1]
    # This warpgroup's buffers and barriers.
    my_vectors, q_smem, k_smem = (slab_vectors.at[warpgroup], qk.at[warpgroup, 0],
                                  qk.at[warpgroup, 1])
    plain_a, plain_b = plain.at[warpgroup, 0], plain.at[warpgroup, 1]
    G_loaded, qk_loaded, dk_state_loaded, dq_state_loaded, late_loaded = (
        barrier.at[warpgroup]
        for barrier in (G_loaded, qk_loaded, dk_state_loaded, dq_state_loaded, late_loaded))

    def tiles(indices):
        return tuple(operands.at[warpgroup, index] for index in indices)

    def slab_columns(step):
        return pl.ds((warpgroup * slabs + step) * SLAB, SLAB)

    def load_G_and_dk_state(columns):  # each awaited where first read
        plgpu.copy_gmem_to_smem(G_gmem.at[(*out, slice(None), columns)], plain_a, G_loaded)
        plgpu.copy_gmem_to_smem(dk_state_gmem.at[(*out, slice(None), columns)], plain_b,
                                dk_state_loaded)

    def load_qk(columns):
        for source, target in ((q_gmem, q_smem), (k_gmem, k_smem)):
            plgpu.copy_gmem_to_smem(source.at[batch, tokens, head // group, columns], target,
                                    qk_loaded)

    load_G_and_dk_state(slab_columns(0))
    load_qk(slab_columns(0))

    @pl.when(warpgroup == 0)
    def _():
        shared = ((daqk_gmem.at[out], daq), (dakk_gmem.at[out], dak),
                  (document_gmem.at[batch, tokens], vectors.at[DOCUMENT]),
                  (q_factor_gmem.at[batch, head // group, tokens], vectors.at[Q_FACTOR]),
                  (k_factor_gmem.at[batch, head // group, tokens], vectors.at[K_FACTOR]))
        for source, target in shared:
            plgpu.copy_gmem_to_smem(source, target, shared_loaded)

    # One warpgroup stores the triangle while the loads run; the other masks dAqk in place like
    # Aqk (causal including the diagonal, same document) once loaded. dAkk comes masked from
    # kernel 1.
    @pl.when(warpgroup == 1)
    def _():
        store_lower_ones(ones)

    plgpu.barrier_wait(shared_loaded)

    @pl.when(warpgroup == 0)
    def _():
        scores_shape = (CHUNK, CHUNK)
        rows, columns = iota(scores_shape, 0), iota(scores_shape, 1)
        daq[...] = jnp.where((columns <= rows) & same_document(vectors.at[DOCUMENT]),
                             plgpu.load(daq, layout=WGMMA), 0.0)

    plgpu.commit_smem()
    plgpu.barrier_arrive(shared_ready)
    plgpu.barrier_wait(shared_ready)

    def normalized(x_smem, factor_row):
        x = plgpu.load(x_smem, layout=WGMMA).astype(jnp.float32)
        return x * per_row(plgpu.load(vectors.at[factor_row], layout=ROW_VECTOR), slab_shape)

    def done(acc, later_groups):
        """acc's value once its products are done; the `later_groups` wgmmas issued after them
        (each `plgpu.wgmma` commits one group) may still run."""
        return plgpu.wgmma_accumulator_load(acc, wait_n=later_groups)

    def tile_of(smem, index):  # the 16 tokens of tile `index` (rows) of a [C, n] operand
        return smem.at[pl.ds(TILE_SIZE * index, TILE_SIZE)]

    def masks():  # built where used rather than held in registers
        return state_masks(vectors.at[DOCUMENT], slab_shape)

    @pl.loop(0, slabs)  # rolled, as are the tile groups below (the module docstring says why)
    def _(step):
        columns = slab_columns(step)

        def load_next_slab(load):  # the next slab's inputs, issued by this one
            if slabs > 1:  # with one slab there is none, and no code for it
                pl.when(step + 1 < slabs)(lambda: load(slab_columns(step + 1)))

        # G's anchors and last row, kept apart in a small table: A takes other values below.
        plgpu.barrier_wait(G_loaded)
        G = load_plain(plain_a)
        anchors = store_anchors(my_vectors, plain_a, lower_bound)
        my_vectors[LAST_G] = plgpu.load(plain_a.at[CHUNK - 1], layout=COLUMN_VECTOR)
        plgpu.commit_smem()
        last_G = plgpu.load(my_vectors.at[LAST_G], layout=COLUMN_VECTOR)

        # d k_to_state's direct terms: the first part of dk's column sums, and the sum of
        # k d k_to_state over the chunk (dG's last row) as the last row of its cumulative sum
        # (over G, read), not as a sum over rows: that would go through the reduction scratch,
        # which both warpgroups would share.
        plgpu.barrier_wait(qk_loaded)
        q, k = normalized(q_smem, Q_FACTOR), normalized(k_smem, K_FACTOR)
        plgpu.barrier_wait(dk_state_loaded)
        dk_to_state = (load_plain(plain_b) * jnp.exp(per_column(last_G, slab_shape) - G)
                       * masks().writes_state)
        plain_a[...] = cumulative_sum(k * dk_to_state, tiles(SUM_PARTS), ones)

        # The column terms' operands: tile t of each holds the tile's rows with the anchor b_t.
        from_anchor = jnp.exp(G - row_anchors(anchors, slab_shape, lower_bound))
        store_split(tiles(Q_COLUMNS), q * from_anchor)
        store_split(tiles(K_COLUMNS), k * from_anchor)
        plgpu.commit_smem()  # the operands and the cumulative sum are stored, B is read
        plgpu.copy_gmem_to_smem(dq_state_gmem.at[(*out, slice(None), columns)], plain_b,
                                dq_state_loaded)
        last_row = plgpu.load(plain_a.at[CHUNK - 1], layout=COLUMN_VECTOR)

        # Column terms (both into dk): tile t's product dAqk[tile t, :]^T X_t(q) + dAkk[tile t,
        # :]^T X_t(k), scaled by exp(b_t - G_s) (zero below the tile, where dA is zero too). The
        # groups are a loop: `first`, the group's first tile, is traced.
        def column_terms(first, sums):
            tile_group = [first + i for i in range(COLUMN_TILES_PER_GROUP)]

            def products(*accs):
                for t, acc in zip(tile_group, accs):
                    for score, parts in ((daq, tiles(Q_COLUMNS)), (dak, tiles(K_COLUMNS))):
                        score_t = tile_of(score, t).transpose((1, 0))
                        for part in parts:
                            plgpu.wgmma(acc, score_t, tile_of(part, t))
                total = sums
                for i, (t, acc) in enumerate(zip(tile_group, accs)):
                    product = done(acc, later_groups=PARTS * 2 * (len(tile_group) - 1 - i))
                    total += jnp.exp(exponent_up_to_tile(G, anchors, t, lower_bound)) * product
                return total

            return pl.run_scoped(products, *(plgpu.ACC(slab_shape) for _ in tile_group))

        dk_columns = pl.loop(0, NUM_TILES, step=COLUMN_TILES_PER_GROUP,
                             init_carry=dk_to_state)(column_terms)

        # The row terms' operand over the column terms' (read: their products are done), and
        # d q_from_state's direct term, the first part of dq's row sums; the column sums wait in
        # B (read), out of the registers the row terms need.
        k = normalized(k_smem, K_FACTOR)
        store_split(tiles(K_ROWS), k * jnp.exp(row_anchors(anchors, slab_shape, lower_bound) - G))
        plgpu.barrier_wait(dq_state_loaded)
        dq_direct = load_plain(plain_b) * jnp.exp(G) * masks().reads_state
        plgpu.commit_smem()  # also: A's last row is read
        plain_b[...] = dk_columns
        plgpu.copy_gmem_to_smem(dk_wy_gmem.at[(*out, slice(None), columns)], plain_a,
                                late_loaded)
        plgpu.copy_gmem_to_smem(ddecay_gmem.at[(*out, columns)], my_vectors.at[D_CHUNK_DECAY],
                                late_loaded)

        # Row terms (dq from dAqk, dk from dAkk): tile t's products dA[:, tile t] F_t, scaled by
        # exp(G_r - b_t) (zero above the tile, where dA is zero too).
        def row_terms(first, sums):
            tile_group = [first + i for i in range(ROW_TILES_PER_GROUP)]

            def products(*accs):
                pairs = list(zip(accs[::2], accs[1::2]))
                for t, accs_t in zip(tile_group, pairs):
                    for acc, score in zip(accs_t, (daq, dak)):
                        score_t = score.at[:, pl.ds(TILE_SIZE * t, TILE_SIZE)]
                        for part in tiles(K_ROWS):
                            plgpu.wgmma(acc, score_t, tile_of(part, t))
                q_sum, k_sum = sums
                for i, (t, (q_acc, k_acc)) in enumerate(zip(tile_group, pairs)):
                    factor = jnp.exp(exponent_from_tile(G, anchors, t, lower_bound))
                    later_tiles = PARTS * 2 * (len(tile_group) - 1 - i)
                    q_sum += factor * done(q_acc, later_groups=PARTS + later_tiles)
                    k_sum += factor * done(k_acc, later_groups=later_tiles)
                return q_sum, k_sum

            return pl.run_scoped(products,
                                 *(plgpu.ACC(slab_shape) for _ in range(2 * len(tile_group))))

        # A loop carry keeps its layout: zeros in the WGMMA layout, not jnp.zeros' splat.
        no_sum = plgpu.layout_cast(jnp.zeros(slab_shape, jnp.float32), WGMMA)
        dq, dk_rows = pl.loop(0, NUM_TILES, step=ROW_TILES_PER_GROUP,
                              init_carry=(dq_direct, no_sum))(row_terms)

        # dG, and the outputs: dq over B, dk over A (both read), dg over B once dq's store has
        # read it.
        plgpu.barrier_wait(late_loaded)
        dk_rows += load_plain(plain_a)
        dk_columns = load_plain(plain_b)
        q, k = normalized(q_smem, Q_FACTOR), normalized(k_smem, K_FACTOR)
        dG = q * dq + k * (dk_rows - dk_columns)
        last_row += (plgpu.load(my_vectors.at[D_CHUNK_DECAY], layout=COLUMN_VECTOR)
                     * jnp.exp(last_G) * masks().keeps_state)
        dG = dG + jnp.where(iota(slab_shape, 0) == CHUNK - 1, per_column(last_row, slab_shape),
                            0.0)
        target = (batch, tokens, head, columns)
        plain_b[...] = dq
        plain_a[...] = dk_rows + dk_columns
        plgpu.commit_smem()  # also: q and k are read, so the next slab's load over them
        plgpu.copy_smem_to_gmem(plain_b, dq_gmem.at[target])
        plgpu.copy_smem_to_gmem(plain_a, dk_gmem.at[target])
        load_next_slab(load_qk)
        # dg = the sum of dG from each row to the chunk's end.
        dg = cumulative_sum(dG, tiles(SUM_PARTS), ones, reverse=True)
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        plain_b[...] = dg
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(plain_b, dg_gmem.at[target])
        # The stores have read A and B: the next slab's G and d k_to_state load over them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        load_next_slab(load_G_and_dk_state)

    plgpu.wait_smem_to_gmem(0)
    # No warpgroup exits while the other may still issue wgmmas.
    plgpu.barrier_arrive(finished)
    plgpu.barrier_wait(finished)


@lowered_once("lower_bound", "group", "warpgroups")
def score_backward(q, k, G, document, q_factor, k_factor, dakk, dk_wy, cotangents, *,
                   lower_bound, group, warpgroups=WARPGROUPS):
    """`_score_backward_kernel` over all (batch row, value head, chunk).

    With `warpgroups = K / 32` (4 at K = 128) every warpgroup takes one slab: the chunk's chain is
    half as long, but the program's 190 KiB of shared memory leave one program an SM (the same 16
    warps as two programs of two warpgroups).

    Args:
      q, k: bf16 [B, T, H, K]; G: float32 [B, HV, N, C, K], the forward's
        (`PreparationResiduals.G`: cumsum(g) within each chunk); document: float32 [B, T]; q_factor,
        k_factor: float32 [B, H, T]; dakk: bf16 [B, HV, N, C, C]; dk_wy: float32
        [B, HV, N, C, K] (T a multiple of 64, K in {64, 128}).
      cotangents: `ChunkedInputs` (Aqk bf16; q_from_state, k_to_state, chunk_decay float32; W
        and U unread).
    Returns:
      (dq, dk, dg) float32 [B, T, HV, K].
    """
    batch, num_value_heads, num_chunks, _, key_dim = G.shape
    if warpgroups < 2:
        raise ValueError(f"warpgroups must be at least 2, got {warpgroups}")
    if key_dim % (warpgroups * SLAB):
        raise ValueError(f"G's key dimension must be a multiple of {warpgroups * SLAB} for "
                         f"{warpgroups} warpgroups, got {key_dim}; use the plain-JAX VJP for "
                         "other sizes")
    slabs = key_dim // (warpgroups * SLAB)
    keyed = jax.ShapeDtypeStruct((batch, num_chunks * CHUNK, num_value_heads, key_dim),
                                 jnp.float32)
    per_warpgroup = lambda *shape: (warpgroups, *shape)  # noqa: E731
    slab_shape = (CHUNK, SLAB)
    warpgroup_barrier = functools.partial(plgpu.Barrier, num_barriers=warpgroups)
    run = plgpu.kernel(
        kernel_body(_score_backward_kernel, lower_bound=lower_bound, group=group, slabs=slabs),
        out_type=(keyed, keyed, keyed),
        grid=(batch, num_value_heads, num_chunks),
        grid_names=("batch", "heads", "chunks"),
        num_threads=warpgroups,
        thread_name="warpgroup",
        scratch_types=(
            tile16_smem((2, CHUNK, CHUNK)),  # dAqk, dAkk
            tile16_smem((CHUNK, CHUNK)),  # the triangle of the cumulative sums
            plgpu.SMEM((K_FACTOR + 1, CHUNK), jnp.float32),
            plgpu.SMEM(per_warpgroup(D_CHUNK_DECAY + 1, SLAB), jnp.float32),
            swizzled_smem(per_warpgroup(2, *slab_shape), OPERAND_DTYPE),  # q, k
            tile16_smem(per_warpgroup(OPERAND_TILES, *slab_shape)),
            plgpu.SMEM(per_warpgroup(2, *slab_shape), jnp.float32),  # A and B
            plgpu.Barrier(num_arrivals=5),  # shared_loaded
            plgpu.Barrier(num_arrivals=warpgroups),  # shared_ready
            plgpu.Barrier(num_arrivals=warpgroups),  # finished
            warpgroup_barrier(),  # G_loaded
            warpgroup_barrier(num_arrivals=2),  # qk_loaded
            warpgroup_barrier(),  # dk_state_loaded
            warpgroup_barrier(),  # dq_state_loaded
            warpgroup_barrier(num_arrivals=2),  # late_loaded: kernel 1's dk term, d chunk_decay
        ),
        compiler_params=COMPILER_PARAMS,
    )
    return run(q, k, G, document, q_factor, k_factor, cotangents.Aqk, dakk,
               cotangents.q_from_state, cotangents.k_to_state, dk_wy, cotangents.chunk_decay)
