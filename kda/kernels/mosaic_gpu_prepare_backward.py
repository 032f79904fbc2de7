"""Pallas Mosaic GPU kernels (Hopper) for the VJP of KDA's chunk preparation with bounded gates.

`prepare_chunks_vjp_kernel` maps cotangents of `kda.chunked.ChunkedInputs` (W, U, q_from_state,
k_to_state, chunk_decay, Aqk) to gradients of q, k, v, g, beta, like `jax.vjp` of
`kda.chunked.prepare_chunks` (chunk 64, `gate_lower_bound` set). Per chunk, with the notation of
`kda/chunked.py` (q, k normalised and q scaled; `E = exp(G)`; `T = (I + N)^-1`, `N = beta Akk`;
`rhs_k = beta k E reads`, `rhs_v = beta v`):

    d rhs_k = T^T dW,   d rhs_v = T^T dU,   dT = dW rhs_k^T + dU rhs_v^T
    dN      = -T^T dT T^T  (strict lower, same document),   dAkk = beta dN
    dv      = beta d rhs_v
    dbeta   = rowsum(dN Akk) + rowsum(d rhs_k k E reads) + rowsum(d rhs_v v)
    dq      = dq_from_state E reads + S_q                      (S: the score terms below)
    dk      = [beta E reads d rhs_k + S_k_rows] + [dk_to_state exp(G_last - G) writes + S_k_columns]
    dG      = q dq + k ([rows] - [columns]),  last row += colsum(k dk_to_state exp(G_last - G)
              writes) + dchunk_decay exp(G_last) keeps
    dg      = reverse cumulative sum of dG within the chunk

where, for a score matrix `A[r, s] = sum_c x_r[c] k_s[c] exp(G_r[c] - G_s[c])` with cotangent dA
(x = q for Aqk, x = k for Akk), the row terms are `sum_s dA[r, s] k_s exp(G_r - G_s)` and the column
terms `sum_r dA[r, s] x_r exp(G_r - G_s)`. Both are 16x16 tile matmuls around the forward's causal
anchors `b_i = G[16 i] + 7.5 L`: the row terms of row tile i are `exp(G_r - b_i)` times
`dA[tile i, :] (k exp(b_i - G))` (columns s < 16 (i + 1)), the column terms of column tile j are
`exp(b_j - G_s)` times `dA[:, tile j]^T (x exp(G - b_j))` (rows r >= 16 j). Every factor stays
within e^(7.5 |L|) <= e^37.5 (far inside bf16's range), or underflows only where the true weight
is below e^-49, as in the forward (`kda.kernels.mosaic_gpu_prepare`).

Two kernels, like peers' "WY" and "intra" backward kernels:

1. `_wy_backward_kernel`, one program per (batch row, value head, chunk), all of K: reads G, Akk
   and T's hi/lo parts as the forward kernel saved them (`PreparationResiduals`: the values W and U
   were made with, so it recomputes nothing of the forward), then computes the gradients through
   the UT transform: dv, dbeta, dAkk (written in bf16, a matmul operand of kernel 2) and
   `beta E reads d rhs_k` (float32), the right-hand sides of the UT transform (v, then k) in steps
   of 64 columns, dT accumulating over the steps.
2. `_score_backward_kernel`, one program per (batch row, value head, chunk, 64 key columns): the
   score terms of both score matrices, computed transposed (`[key column, token]`: wgmma's M = 64
   runs over key columns, N = 16 over the tokens of one tile, so no product is wasted) and turned
   back through shared memory as bf16 hi/lo pairs (Mosaic GPU transposes only 16-bit data), then
   the direct terms, dG and its reverse cumulative sum as a triangular matmul of an exact 3-way
   bf16 split (`cumulative_sum` with `reverse`).

Around the kernels, plain JAX computes the q/k inverse norms, and applies the VJP of
`kda.common.prepare_qk` (`prepare_qk_vjp`: the scale, the L2 norm's backward and the sum over the
value heads of a group), crops the padded tail and casts.

Numerics: matmul operands bf16, accumulation and everything elementwise float32. T (the forward's)
is used as a hi/lo bf16 pair where it produces dv and dk directly; dT, dN and the score cotangents
are single bf16; the factors of the score terms are hi/lo pairs. Against `jax.vjp` of the plain-JAX
preparation (float32, random normal cotangents, interpret mode, K = 64, documents, saturated gates
included), relative errors are dq 2.4-2.8e-3, dk 0.7-1.9e-3, dv 2.8e-3, dg 1.9-2.5e-3 and dbeta
1.7-1.8e-3 (fla's bf16 bars: 8e-3 and 2e-2).

Shared memory per program (the launch's dynamic SMEM: buffers, 1 KiB alignment, barriers and the
2 KiB reduction scratch): kernel 1 107 KiB at K = V = 128 (91 KiB at 64; 206 and 126 KiB before), so
two programs share an SM (228 KiB, 1 KiB of it reserved a program) and hide each other's latencies;
kernel 2 69 KiB at any K (it sees 64 key columns; 206, then 101 KiB before), within the 75 KiB of
three programs an SM (which also need at most 168 registers a thread). Both give buffers with
disjoint lifetimes one memory (`plgpu.RefUnion`, so interpret mode's race detection checks the
reuse), and await each input where it is first read. Kernel 1: G (float32), Akk, T's two parts and
two steps' inputs, each in its own buffer; dT (then dAkk) and a step's bf16 right-hand side (then
T^T dT), then a step's float32 output. The right-hand sides run in 64-column steps (the dU or dW
slice, bf16 as given, and the v or k columns of a step in one of two slots, the step after next's
loading while a step computes; the wgmmas read the cotangent where TMA put it), so only G spans all
of K. Kernel 2: g, then the four bf16 operands of the cumulative sums, row terms and column terms
(q's and k's column factors take turns in two hi/lo pairs rather than holding four), between those
two the untransposes' hi/lo parts and d q_from_state (then dq) in the operands' place; dAqk (bf16 as
given, masked in place) and dAkk, then d k_to_state and dg; q and k, then kernel 1's dk term, dk's
row terms and dk. So its three float32 [C, 64] cotangents load once their memory is free rather than
at the start: d q_from_state after the row terms and kernel 1's dk term once q is read (both while
other work runs), d k_to_state after the column terms (its latency exposed: nothing is free while
they run). Its anchors and G's last row are kept apart from G (`StoredAnchors`, 3 KiB instead of G's
16), the score cotangents are transposed in place after the row terms, and dq is stored as soon as
it is done (its TMA has read it before the column terms take the memory back).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.chunked import TILE_SIZE, ChunkedInputs
from kda.common import L2_NORM_EPS, prepare_qk_vjp
from kda.kernels.mosaic_gpu_common import (OPERAND_DTYPE, SUPPORTED_DIMS, PreparationResiduals,
                                           swizzled_smem)
from kda.kernels.mosaic_gpu_score_backward import score_backward
from kda.kernels.mosaic_gpu_tiles import (CHUNK, COLUMN_VECTOR, COMPILER_PARAMS, NUM_TILES,
                                          ROW_VECTOR, WGMMA, cumulative_sum, documents_in_chunk,
                                          exponent_from_tile, exponent_up_to_tile, iota,
                                          load_plain, matmul, matmul_of_splits, pad_to_chunks,
                                          per_column, per_row, row_anchors, same_document,
                                          state_masks, store_anchors, store_lower_ones,
                                          store_split)

KEY_SLICE = 64  # key columns per program of the score kernel (wgmma's M)
# The cotangents (`ChunkedInputs` fields) the kernels use only as bf16 matmul operands: given in
# bf16, they give the same gradients in half the bytes.
ROUNDED_COTANGENTS = ("W", "U", "Aqk")


# Kernel 1: gradients through the UT transform.

HALF = 64  # key or value columns a step of kernel 1's right-hand sides covers
# Rows of kernel 1's table of float32 [C] vectors.
BETA, WY_DOCUMENT, WY_K_FACTOR, D_BETA = range(4)


def _wy_backward_kernel(k_gmem, v_gmem, beta_gmem, document_gmem, k_factor_gmem, G_gmem,
                        akk_gmem, inverse_gmem, dw_gmem, du_gmem,
                        dv_gmem, dbeta_gmem, dakk_gmem, dk_wy_gmem, *, group):
    """One (batch row, value head, chunk) program.

    GMEM inputs: k [B, T, H, K] and v [B, T, HV, V] in bf16; beta [B, HV, T], document [B, T],
    k_factor [B, H, T] (k's inverse norm) in float32; the forward's `PreparationResiduals`: G
    [B, HV, N, C, K] float32, Akk [B, HV, N, C, C] and T's hi/lo parts [B, HV, N, 2, C, C] bf16;
    the cotangents dW [B, HV, N, C, K] and dU [B, HV, N, C, V] in bf16. T is a multiple of 64.
    Outputs: dv [B, T, HV, V] bf16, dbeta [B, HV, T] float32, dAkk [B, HV, N, C, C] bf16 (masked,
    beta included), `beta E reads d rhs_k` [B, HV, N, C, K] float32.
    """
    key_dim = k_gmem.shape[-1]
    batch, head, chunk = (lax.axis_index(axis) for axis in ("batch", "heads", "chunks"))
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    out = (batch, head, chunk)
    half_shape, scores_shape = (CHUNK, HALF), (CHUNK, CHUNK)
    # The right-hand sides' steps: (v or k, 64-column half), the v steps first.
    steps = [(part, half) for part in "vk" for half in range(key_dim // HALF)]
    first_k_step = key_dim // HALF

    def body(vectors, G_smem, akk, inverse_smem, x_buffers, cotangent_buffers, products,
             barriers):
        # products: dT (then dAkk) and a step's bf16 right-hand side (then T^T dT), then a
        # step's float32 output.
        (dT_smem, rhs), out_staging = products
        inverse_t = tuple(inverse_smem.at[part].transpose((1, 0)) for part in range(2))  # T^T
        beta_smem, document_smem, k_factor_smem, dbeta_smem = (
            vectors.at[row] for row in (BETA, WY_DOCUMENT, WY_K_FACTOR, D_BETA))
        # In the order of first use, each awaited where first read; the first two steps' inputs
        # load between those the v steps read and those the k steps read.
        inputs = ((document_gmem.at[batch, tokens], document_smem),
                  (beta_gmem.at[batch, head, tokens], beta_smem),
                  (inverse_gmem.at[out], inverse_smem),
                  (k_factor_gmem.at[batch, head // group, tokens], k_factor_smem),
                  (G_gmem.at[out], G_smem),
                  (akk_gmem.at[out], akk))
        (document_loaded, beta_loaded, inverse_loaded, k_factor_loaded, G_loaded,
         akk_loaded) = (barriers.at[index] for index in range(len(inputs)))
        x_loaded, cotangent_loaded = (
            tuple(barriers.at[len(inputs) + 2 * role + slot] for slot in range(2))
            for role in range(2))

        def load_inputs(indices):
            for index in indices:
                source, target = inputs[index]
                plgpu.copy_gmem_to_smem(source, target, barriers.at[index])

        def load_step_inputs(index):
            """Step index's 64 columns of v and dU or of k and dW, into the step's slot of two."""
            part, half = steps[index]
            keys = pl.ds(HALF * half, HALF)
            if part == "v":
                x_source, cotangent_source = v_gmem.at[batch, tokens, head, keys], du_gmem
            else:
                x_source, cotangent_source = k_gmem.at[batch, tokens, head // group, keys], dw_gmem
            slot = index % 2
            plgpu.copy_gmem_to_smem(x_source, x_buffers[slot], x_loaded[slot])
            plgpu.copy_gmem_to_smem(cotangent_source.at[(*out, slice(None), keys)],
                                    cotangent_buffers[slot], cotangent_loaded[slot])

        load_inputs(range(3))
        load_step_inputs(0)
        load_step_inputs(1)
        load_inputs(range(3, len(inputs)))

        # Step by step: the cotangent (of U or W, bf16 from GMEM) and the right-hand side (rhs_v =
        # beta v or rhs_k = beta k E reads) of 64 columns; dT accumulates dU rhs_v^T + dW rhs_k^T;
        # then dv = beta T^T dU (over rhs_v) or dk's UT term beta E reads T^T dW, and dbeta's v or
        # k term. The step after next's inputs load while this one computes.
        plgpu.barrier_wait(document_loaded)
        reads_state = state_masks(document_smem, half_shape).reads_state
        plgpu.barrier_wait(beta_loaded)
        beta_of_row = plgpu.load(beta_smem, layout=ROW_VECTOR)
        beta = per_row(beta_of_row, half_shape)

        def normalized_k(smem):
            k = plgpu.load(smem, layout=WGMMA).astype(jnp.float32)
            return k * per_row(plgpu.load(k_factor_smem, layout=ROW_VECTOR), half_shape)

        def decay_read(keys):  # E reads, recomputed where needed rather than held in registers
            return jnp.exp(load_plain(G_smem.at[:, keys])) * reads_state

        def gradients(d_inverse):
            dbeta = None
            for index, (part, half) in enumerate(steps):
                keys = pl.ds(HALF * half, HALF)
                x_smem, cotangent = x_buffers[index % 2], cotangent_buffers[index % 2]

                def load_v():
                    return plgpu.load(x_smem, layout=WGMMA).astype(jnp.float32)

                def load_k():
                    return normalized_k(x_smem)

                plgpu.barrier_wait(x_loaded[index % 2])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's output is read
                if index == first_k_step:
                    plgpu.barrier_wait(k_factor_loaded)
                    plgpu.barrier_wait(G_loaded)
                if part == "v":
                    rhs[...] = (beta * load_v()).astype(OPERAND_DTYPE)
                else:
                    rhs[...] = (beta * load_k() * decay_read(keys)).astype(OPERAND_DTYPE)
                plgpu.commit_smem()
                plgpu.barrier_wait(cotangent_loaded[index % 2])
                plgpu.wgmma(d_inverse, cotangent, rhs.transpose((1, 0)))
                if index == 0:
                    plgpu.barrier_wait(inverse_loaded)
                d_rhs = matmul_of_splits(inverse_t, (cotangent,), half_shape)
                if part == "v":  # dv, over rhs_v (its product is done)
                    term = jnp.sum(d_rhs * load_v(), axis=1)
                    output, target = rhs, dv_gmem.at[batch, tokens, head, keys]
                    output[...] = (beta * d_rhs).astype(output.dtype)
                else:
                    term = jnp.sum(d_rhs * load_k() * decay_read(keys), axis=1)
                    output, target = out_staging, dk_wy_gmem.at[(*out, slice(None), keys)]
                    output[...] = beta * decay_read(keys) * d_rhs
                dbeta = term if dbeta is None else dbeta + term
                # Also: x is read (and the cotangent by the products) before TMA reuses the slot.
                plgpu.commit_smem()
                if index + 2 < len(steps):
                    load_step_inputs(index + 2)
                plgpu.copy_smem_to_gmem(output, target)
            return d_inverse[...], dbeta

        dT, dbeta = pl.run_scoped(gradients, plgpu.ACC(scores_shape))

        # dN = -T^T dT T^T on the entries N has (strict lower, same document); dAkk = beta dN.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's output is read
        product = rhs
        dT_smem[...] = dT.astype(OPERAND_DTYPE)
        plgpu.commit_smem()
        product[...] = matmul(inverse_t[0], dT_smem, scores_shape).astype(OPERAND_DTYPE)
        plgpu.commit_smem()
        dN = -matmul(product, inverse_t[0], scores_shape)
        rows, columns = iota(scores_shape, 0), iota(scores_shape, 1)
        dN = jnp.where((columns < rows) & same_document(document_smem), dN, 0.0)
        plgpu.barrier_wait(akk_loaded)
        dbeta += jnp.sum(dN * plgpu.load(akk, layout=WGMMA).astype(jnp.float32), axis=1)
        dakk = dT_smem  # dT's product is done
        dakk[...] = (per_row(beta_of_row, scores_shape) * dN).astype(OPERAND_DTYPE)
        dbeta_smem[...] = dbeta
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dakk, dakk_gmem.at[out])
        plgpu.copy_smem_to_gmem(dbeta_smem, dbeta_gmem.at[batch, head, tokens])
        plgpu.wait_smem_to_gmem(0)

    tile = swizzled_smem(half_shape, OPERAND_DTYPE)  # [C, 64] = [C, C] bf16
    pl.run_scoped(
        body,
        plgpu.SMEM((D_BETA + 1, CHUNK), jnp.float32),  # the vectors (rows above)
        plgpu.SMEM((CHUNK, key_dim), jnp.float32),  # G (plain rows: read by column halves)
        tile,  # Akk
        swizzled_smem((2, *scores_shape), OPERAND_DTYPE),  # T's hi and lo parts
        (tile, tile),  # two steps' v or k columns
        (tile, tile),  # two steps' dU or dW columns
        plgpu.RefUnion((tile, tile), swizzled_smem(half_shape, jnp.float32)),
        plgpu.Barrier(num_barriers=10),
    )


# Kernel 2: gradients through the score tiles, the direct terms, dG and dg.

# Rows of the score kernel's table of float32 vectors (C = 64 tokens or 64 key columns each).
DOCUMENT, Q_FACTOR, K_FACTOR, D_CHUNK_DECAY, LAST_G = range(5)


def _score_backward_kernel(q_gmem, k_gmem, g_gmem, document_gmem, q_factor_gmem, k_factor_gmem,
                           daqk_gmem, dakk_gmem, dq_state_gmem, dk_state_gmem, dk_wy_gmem,
                           ddecay_gmem, dq_gmem, dk_gmem, dg_gmem,
                           *, lower_bound, group, slices):
    """One (batch row, value head, chunk, 64 key columns) program.

    GMEM inputs: q, k [B, T, H, K] bf16; g [B, T, HV, K], document [B, T], q_factor and k_factor
    [B, H, T] (inverse norms, q's times the scale) in float32; dAqk [B, HV, N, C, C] and
    dAkk [B, HV, N, C, C] (kernel 1) in bf16; d q_from_state, d k_to_state and kernel 1's dk term
    [B, HV, N, C, K] and d chunk_decay [B, HV, N, K] in float32.
    Outputs: dq, dk (of the normalised, scaled q and k) and dg, float32 [B, T, HV, K].
    """
    batch, head, program = (lax.axis_index(axis) for axis in ("batch", "heads", "chunks"))
    chunk, key_slice = lax.div(program, slices), lax.rem(program, slices)
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    keys = pl.ds(key_slice * KEY_SLICE, KEY_SLICE)
    out = (batch, head, chunk)
    keys_shape, scores_shape = (CHUNK, KEY_SLICE), (CHUNK, CHUNK)
    transposed_shape = (KEY_SLICE, CHUNK)

    def body(vectors, anchors_smem, scores, work, inputs_qk, barriers):
        # scores: dAqk and dAkk (bf16 [C, C]), transposed in place for the column terms; then
        # d k_to_state (float32), then dg. work: g (then G); the four bf16 [C, 64] operands of
        # the cumulative sums and the row and column terms; between the row and the column
        # terms, the hi/lo parts of the row terms' untransposes and d q_from_state (then dq)
        # over the last two operands. inputs_qk: q and k (bf16), then kernel 1's dk term
        # (float32), then dk's row terms, then dk.
        (daq, dak), dk_state_smem = scores
        g_smem, (*untranspose_parts, dq_smem), tiles = work
        (q_smem, k_smem), dk_smem = inputs_qk
        document_smem = vectors.at[DOCUMENT]
        # In the order of first use; each awaited where first read. The three float32 [C, 64]
        # cotangents load once their memory is free (below).
        inputs = ((g_gmem.at[batch, tokens, head, keys], g_smem),
                  (document_gmem.at[batch, tokens], document_smem),
                  (daqk_gmem.at[out], daq),
                  (k_gmem.at[batch, tokens, head // group, keys], k_smem),
                  (k_factor_gmem.at[batch, head // group, tokens], vectors.at[K_FACTOR]),
                  (dakk_gmem.at[out], dak),
                  (q_gmem.at[batch, tokens, head // group, keys], q_smem),
                  (q_factor_gmem.at[batch, head // group, tokens], vectors.at[Q_FACTOR]),
                  (ddecay_gmem.at[(*out, keys)], vectors.at[D_CHUNK_DECAY]))
        for index, (source, target) in enumerate(inputs):
            plgpu.copy_gmem_to_smem(source, target, barriers.at[index])
        (g_loaded, document_loaded, daqk_loaded, k_loaded, k_factor_loaded, dakk_loaded, q_loaded,
         q_factor_loaded, ddecay_loaded, dq_loaded, dk_loaded, dk_state_loaded) = (
            barriers.at[index] for index in range(len(inputs) + 3))

        def load_cotangent(source, target, barrier):  # once the target's memory is read
            plgpu.commit_smem()
            plgpu.copy_gmem_to_smem(source.at[(*out, slice(None), keys)], target, barrier)

        rows, columns = iota(scores_shape, 0), iota(scores_shape, 1)

        # dAqk masked in place like Aqk (causal including the diagonal, same document); dAkk comes
        # masked from kernel 1.
        plgpu.barrier_wait(document_loaded)
        plgpu.barrier_wait(daqk_loaded)
        daq[...] = jnp.where((columns <= rows) & same_document(document_smem),
                             plgpu.load(daq, layout=WGMMA), 0.0)

        # G = cumsum(g) (over g, read), back in g's place for the anchors and the last row, kept
        # apart before the work space takes four operands.
        plgpu.barrier_wait(g_loaded)
        g = load_plain(g_smem)
        plgpu.commit_smem()
        ones = tiles.at[3]  # [C, C] = [C, 64]: the same shape
        store_lower_ones(ones)
        cumsum_parts = (tiles.at[0], tiles.at[1], tiles.at[2])
        G = cumulative_sum(g, cumsum_parts, ones)
        g_smem[...] = G
        plgpu.commit_smem()
        anchors = store_anchors(anchors_smem, g_smem, lower_bound)
        vectors[LAST_G] = plgpu.load(g_smem.at[CHUNK - 1], layout=COLUMN_VECTOR)
        plgpu.commit_smem()

        def normalized(smem, factor_smem):
            x = plgpu.load(smem, layout=WGMMA).astype(jnp.float32)
            return x * per_row(plgpu.load(factor_smem, layout=ROW_VECTOR), keys_shape)

        plgpu.barrier_wait(k_loaded)
        plgpu.barrier_wait(k_factor_loaded)
        k = normalized(k_smem, vectors.at[K_FACTOR])
        plgpu.barrier_wait(dakk_loaded)

        # Row terms, transposed ([key column c, token r]), the factor exp(G_r - b_i) left out:
        # tile i's columns are (k exp(b_i - G))^T dA[tile i, :]^T for both score matrices. The
        # factors enter as exact-to-2^-16 hi/lo pairs, as in the column terms: dG takes row minus
        # column terms that cancel (exactly on the diagonal), so their roundings must not differ.
        row_buffers = ((tiles.at[0], tiles.at[1]), (tiles.at[2], tiles.at[3]))

        def row_terms(q_acc, k_acc):
            for i in range(NUM_TILES):
                if i >= 2:  # the four products of tile i - 2 read these buffers
                    plgpu.wgmma_wait(4)
                parts = row_buffers[i % 2]
                store_split(parts, k * jnp.exp(exponent_up_to_tile(G, anchors, i, lower_bound)))
                plgpu.commit_smem()
                tile_rows = slice(TILE_SIZE * i, TILE_SIZE * (i + 1))
                for acc, cotangent in ((q_acc, daq), (k_acc, dak)):
                    for part in parts:
                        plgpu.wgmma(acc.at[:, tile_rows], part.transpose((1, 0)),
                                    cotangent.at[tile_rows].transpose((1, 0)))
            return q_acc[...], k_acc[...]

        q_rows_t, k_rows_t = pl.run_scoped(row_terms, plgpu.ACC(transposed_shape),
                                           plgpu.ACC(transposed_shape))
        load_cotangent(dq_state_gmem, dq_smem, dq_loaded)  # over the last two operands

        # The column terms read the score cotangents transposed: in place, all loads before any
        # store.
        cotangents = [plgpu.load(x, layout=WGMMA) for x in (daq, dak)]
        plgpu.commit_smem()
        for x, value in zip((daq, dak), cotangents):
            x.transpose((1, 0))[...] = value
        daq_t, dak_t = daq, dak

        # Back to [token, key column] through SMEM: bf16 hi and lo parts, stored transposed.
        def untransposed(values_t, parts):
            store_split(tuple(part.transpose((1, 0)) for part in parts), values_t)
            plgpu.commit_smem()
            return sum(plgpu.load(part, layout=WGMMA).astype(jnp.float32) for part in parts)

        # dq (stored now, its TMA overlapping dk's row terms) and dk's row terms.
        q_rows = untransposed(q_rows_t, untranspose_parts)
        plgpu.barrier_wait(q_loaded)
        plgpu.barrier_wait(q_factor_loaded)
        q = normalized(q_smem, vectors.at[Q_FACTOR])
        load_cotangent(dk_wy_gmem, dk_smem, dk_loaded)  # over q and k
        masks = state_masks(document_smem, keys_shape)
        anchor_exponent = G - row_anchors(anchors, keys_shape, lower_bound)
        plgpu.barrier_wait(dq_loaded)
        dq = (load_plain(dq_smem) * jnp.exp(G) * masks.reads_state
              + jnp.exp(anchor_exponent) * q_rows)
        dq_smem[...] = dq
        q_dq = q * dq
        plgpu.commit_smem()
        target = (batch, tokens, head, keys)
        plgpu.copy_smem_to_gmem(dq_smem, dq_gmem.at[target])
        k_rows = untransposed(k_rows_t, untranspose_parts)
        plgpu.barrier_wait(dk_loaded)
        dk_smem[...] = load_plain(dk_smem) + jnp.exp(anchor_exponent) * k_rows
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dq is read before the operands return

        # Column terms, transposed, the factor exp(b_j - G_s) left out: tile j's columns are
        # (q exp(G - b_j))^T dAqk[:, tile j] + (k exp(G - b_j))^T dAkk[:, tile j], rows r >= 16 j.
        # q's and k's factors take turns in two buffer pairs.
        column_buffers = row_buffers

        def column_terms(acc):
            for j in range(NUM_TILES):
                row_factor = jnp.exp(exponent_from_tile(G, anchors, j, lower_bound))
                tile_columns = slice(TILE_SIZE * j, TILE_SIZE * (j + 1))
                for x_index, (x, cotangent_t) in enumerate(((q, daq_t), (k, dak_t))):
                    if j >= 1:  # the two products two turns back read these buffers
                        plgpu.wgmma_wait(2)
                    parts = column_buffers[x_index]
                    store_split(parts, x * row_factor)
                    plgpu.commit_smem()
                    for part in parts:
                        plgpu.wgmma(acc.at[:, tile_columns], part.transpose((1, 0)),
                                    cotangent_t.at[tile_columns].transpose((1, 0)))
            return acc[...]

        k_columns_t = pl.run_scoped(column_terms, plgpu.ACC(transposed_shape))
        load_cotangent(dk_state_gmem, dk_state_smem, dk_state_loaded)  # over the score cotangents
        k_columns = untransposed(k_columns_t, (tiles.at[0], tiles.at[1]))

        # The anchor factors, the direct terms, and dG.
        last_G = plgpu.load(vectors.at[LAST_G], layout=COLUMN_VECTOR)
        plgpu.barrier_wait(dk_state_loaded)
        plgpu.barrier_wait(ddecay_loaded)
        dk_to_state = (load_plain(dk_state_smem) * jnp.exp(per_column(last_G, keys_shape) - G)
                       * masks.writes_state)
        dk_columns = dk_to_state + jnp.exp(-anchor_exponent) * k_columns
        dk_rows = load_plain(dk_smem)
        dG = q_dq + k * (dk_rows - dk_columns)
        last_row = (jnp.sum(k * dk_to_state, axis=0)
                    + plgpu.load(vectors.at[D_CHUNK_DECAY], layout=COLUMN_VECTOR)
                    * jnp.exp(last_G) * masks.keeps_state)
        dG = dG + jnp.where(iota(keys_shape, 0) == CHUNK - 1, per_column(last_row, keys_shape),
                            0.0)
        dk_smem[...] = dk_rows + dk_columns
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_smem, dk_gmem.at[target])
        # dg = the sum of dG from each row to the chunk's end, over d k_to_state (read).
        store_lower_ones(ones)
        dg_smem = dk_state_smem
        dg_smem[...] = cumulative_sum(dG, cumsum_parts, ones, reverse=True)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dg_smem, dg_gmem.at[target])
        plgpu.wait_smem_to_gmem(0)

    tile = swizzled_smem(keys_shape, OPERAND_DTYPE)  # [C, 64] = [C, C] bf16
    plain = plgpu.SMEM(keys_shape, jnp.float32)
    pl.run_scoped(
        body,
        plgpu.SMEM((LAST_G + 1, CHUNK), jnp.float32),  # the vectors (rows above)
        plgpu.SMEM((NUM_TILES, KEY_SLICE), jnp.float32),  # the anchors
        plgpu.RefUnion((tile, tile), plain),
        plgpu.RefUnion(plain, (tile, tile, plain),
                       swizzled_smem((4, *keys_shape), OPERAND_DTYPE)),
        plgpu.RefUnion((tile, tile), plain),
        plgpu.Barrier(num_barriers=12),
    )


def _score_backward(q, k, g, document, q_factor, k_factor, dakk, dk_wy, cotangents, *,
                    lower_bound, group):
    """Kernel 2 over all (batch row, value head, chunk, 64 key columns).

    Args:
      q, k, g, document, q_factor, k_factor, dakk, dk_wy: `_score_backward_kernel`'s GMEM inputs
        of those names (T a multiple of 64).
      cotangents: `ChunkedInputs` as `prepare_chunks_vjp_kernel` hands them on (Aqk bf16;
        q_from_state, k_to_state, chunk_decay float32; W and U unread).
    Returns:
      (dq, dk, dg) float32 [B, T, HV, K].
    """
    batch, length, num_value_heads, key_dim = g.shape
    slices = key_dim // KEY_SLICE
    keyed = jax.ShapeDtypeStruct(g.shape, jnp.float32)
    run = plgpu.kernel(
        functools.partial(_score_backward_kernel, lower_bound=lower_bound, group=group,
                          slices=slices),
        out_type=(keyed, keyed, keyed),
        grid=(batch, num_value_heads, length // CHUNK * slices),
        grid_names=("batch", "heads", "chunks"),
        compiler_params=COMPILER_PARAMS,
    )
    return run(q, k, g, document, q_factor, k_factor, cotangents.Aqk, dakk,
               cotangents.q_from_state, cotangents.k_to_state, dk_wy, cotangents.chunk_decay)


def _inverse_norms(x, use_qk_l2norm, padded_length):
    """float32 [B, H, T']: `rsqrt(sum(x^2) + eps)` per token and head (ones without the norm)."""
    x = x.astype(jnp.float32)
    if use_qk_l2norm:
        factor = lax.rsqrt(jnp.sum(x * x, axis=-1) + L2_NORM_EPS)
    else:
        factor = jnp.ones(x.shape[:-1], jnp.float32)
    factor = jnp.pad(factor, ((0, 0), (0, padded_length - x.shape[1]), (0, 0)))
    return jnp.moveaxis(factor, 1, 2)


def prepare_chunks_vjp_kernel(q, k, v, g, beta, *, scale, segment_ids, use_qk_l2norm,
                              gate_lower_bound, residuals: PreparationResiduals,
                              cotangents: ChunkedInputs):
    """The VJP of `kda.chunked.prepare_chunks` (chunk 64, bounded gates) by the two kernels.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V] (K = V in {64, 128}); g: [B, T, HV, K], every
        g >= gate_lower_bound; beta: [B, T, HV].
      scale, segment_ids, use_qk_l2norm: as in `kda.chunked.chunk_kda`.
      gate_lower_bound: L in [-5, 0).
      residuals: what the preparation kernel saved for its backward on these inputs
        (`kda.kernels.mosaic_gpu_prepare.prepare_chunks_kernel` with `save_for_backward`).
      cotangents: `ChunkedInputs` [B, HV, N, ...], N = ceil(T / 64) (k_to_state [C, K], not
        transposed). The kernels read W, U and Aqk in bf16 (`ROUNDED_COTANGENTS`: they use them
        only as bf16 matmul operands; a caller that can produce them in bf16 saves the bytes) and
        the others in float32.
    Returns:
      (dq, dk, dv, dg, dbeta) with the shapes and dtypes of q, k, v, g, beta.
    """
    batch, length, num_value_heads, value_dim = v.shape
    num_heads, key_dim = q.shape[2:]
    if key_dim != value_dim or key_dim not in SUPPORTED_DIMS:
        raise ValueError(f"q/k and v need equal head sizes in {SUPPORTED_DIMS}, got K={key_dim}, "
                         f"V={value_dim}; use the plain-JAX VJP for other sizes")
    if gate_lower_bound is None or not -5.0 <= gate_lower_bound < 0.0:
        raise ValueError(f"gate_lower_bound must be in [-5, 0), got {gate_lower_bound}; the "
                         "kernels build their score tiles around it")
    num_chunks = -(-length // CHUNK)
    padded_length = num_chunks * CHUNK

    padded = functools.partial(pad_to_chunks, padded_length=padded_length)
    group = num_value_heads // num_heads
    q_bf16, k_bf16 = padded(q, OPERAND_DTYPE), padded(k, OPERAND_DTYPE)
    document = documents_in_chunk(segment_ids, batch, padded_length)
    k_factor = _inverse_norms(k, use_qk_l2norm, padded_length)
    q_factor = _inverse_norms(q, use_qk_l2norm, padded_length) * scale
    cotangents = ChunkedInputs(*(
        x.astype(OPERAND_DTYPE if name in ROUNDED_COTANGENTS else jnp.float32)
        for name, x in zip(ChunkedInputs._fields, cotangents)))
    chunked = lambda *tail: (batch, num_value_heads, num_chunks, *tail)  # noqa: E731
    lower_bound = float(gate_lower_bound)

    wy_backward = plgpu.kernel(
        functools.partial(_wy_backward_kernel, group=group),
        out_type=(jax.ShapeDtypeStruct((batch, padded_length, num_value_heads, value_dim),
                                       OPERAND_DTYPE),
                  jax.ShapeDtypeStruct((batch, num_value_heads, padded_length), jnp.float32),
                  jax.ShapeDtypeStruct(chunked(CHUNK, CHUNK), OPERAND_DTYPE),
                  jax.ShapeDtypeStruct(chunked(CHUNK, key_dim), jnp.float32)),
        grid=(batch, num_value_heads, num_chunks),
        grid_names=("batch", "heads", "chunks"),
        compiler_params=COMPILER_PARAMS,
    )
    dv, dbeta, dakk, dk_wy = wy_backward(
        k_bf16, padded(v, OPERAND_DTYPE), jnp.moveaxis(padded(beta, jnp.float32), 1, 2),
        document, k_factor, *residuals, cotangents.W, cotangents.U)

    dq, dk, dg = score_backward(q_bf16, k_bf16, padded(g, jnp.float32), document, q_factor,
                                k_factor, dakk, dk_wy, cotangents, lower_bound=lower_bound,
                                group=group)

    # The scale, the L2 norm's backward and the sum over each group's value heads.
    dq, dk = prepare_qk_vjp(q, k, dq[:, :length], dk[:, :length], scale=scale,
                            use_qk_l2norm=use_qk_l2norm)
    return (dq, dk, dv[:, :length].astype(v.dtype), dg[:, :length].astype(g.dtype),
            jnp.moveaxis(dbeta, 1, 2)[:, :length].astype(beta.dtype))
