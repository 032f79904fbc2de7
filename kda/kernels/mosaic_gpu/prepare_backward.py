"""The VJP of KDA's chunk preparation with bounded gates: Pallas Mosaic GPU kernels (Hopper).

`prepare_chunks_vjp_kernel` maps cotangents of `kda.chunked.ChunkedInputs` to dq, dk [B, T, H, K],
dv, dg, dbeta like `jax.vjp` of `kda.chunked.prepare_chunks` (chunk 64, `gate_lower_bound` set).
Per chunk, in the notation of `kda/chunked.py` and `docs/kda_chunked.md` (q, k normalised, q
scaled; `E = exp(G)`; `T = (I + N)^-1`, `N = beta Akk`; `rhs_k = beta k E reads`, `rhs_v = beta v`):

    d rhs_k = T^T dW,   d rhs_v = T^T dU,   dT = dW rhs_k^T + dU rhs_v^T
    dN      = -T^T dT T^T  (strict lower, same document),   dAkk = beta dN
    dv      = beta d rhs_v,   dbeta = rowsum(dN Akk) + rowsum(d rhs_k k E reads) + rowsum(d rhs_v v)
    dq      = dq_from_state E reads + S_q
    dk      = [beta E reads d rhs_k + S_k_rows] + [dk_to_state exp(G_last - G) writes + S_k_columns]
    dG      = q dq + k ([rows] - [columns]),  last row += colsum(k dk_to_state exp(G_last - G)
              writes) + dchunk_decay exp(G_last) keeps;   dg = reverse cumsum of dG in the chunk

S are the score terms: for `A[r, s] = sum_c x_r[c] k_s[c] exp(G_r[c] - G_s[c])` with cotangent dA
(x = q for Aqk, k for Akk), the row terms `sum_s dA[r, s] k_s exp(G_r - G_s)` and the column terms
`sum_r dA[r, s] x_r exp(G_r - G_s)`. Two kernels (like peers' "WY" and "intra" kernels), each one
program per (batch row, value head, chunk):
1. `_wy_backward_kernel`, one warpgroup over all of K: reads G, Akk and T's hi/lo parts as the
   forward saved them (`PreparationResiduals`, so nothing of the forward is recomputed) and writes
   dv, dbeta, dAkk (bf16: the next kernel's matmul operand) and `beta E reads d rhs_k`. The
   right-hand sides (v's, then k's) go in 64-column steps of one rolled loop (smaller code:
   `tiles.scanned_cumulative_sum` says why), dT accumulating; a step's inputs load two steps ahead.
2. `kda.kernels.mosaic_gpu.score_backward`, two warpgroups: the S terms, the direct terms, dG, dg.
Plain JAX computes the q/k inverse norms, crops and casts; the VJP of `kda.common.prepare_qk`
follows, by `l2_norm_vjp_kernel` (one pass where XLA takes two) with the norm, one value head per
q/k head and bf16 q, k, else by `prepare_qk_vjp`.

Numerics: bf16 matmul operands, float32 accumulation and elementwise math; T is a hi/lo pair where
it makes dv and dk directly, dT, dN and the score cotangents single bf16. Against `jax.vjp` of the
plain-JAX preparation (float32, interpret mode, K = 64, documents, saturated gates) relative
errors are dq 2.4-2.8e-3, dk 0.7-1.9e-3, dv 2.8e-3, dg 1.9-2.5e-3, dbeta 1.7-1.8e-3 (fla's bf16
bars: 8e-3 and 2e-2). Kernel 1 takes 107 KiB of SMEM at K = V = 128 (91 at 64), so two programs
share an SM (228 KiB, 1 KiB reserved a program) and hide each other's latencies.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.chunked import ChunkedInputs
from kda.common import L2_NORM_EPS, prepare_qk_vjp
from kda.kernels.mosaic_gpu.common import (OPERAND_DTYPE, SUPPORTED_DIMS, PreparationResiduals,
                                           kernel_body, lowered_once, swizzled_smem)
from kda.kernels.mosaic_gpu.l2_norm_backward import l2_norm_vjp_kernel
from kda.kernels.mosaic_gpu.score_backward import score_backward
from kda.kernels.mosaic_gpu.tiles import (CHUNK, COMPILER_PARAMS, ROW_VECTOR, WGMMA,
                                          documents_in_chunk, iota, load_plain, matmul,
                                          matmul_of_splits, pad_to_chunks, per_row,
                                          same_document, state_masks)

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
    # The right-hand sides' steps: step i covers 64 columns, half i % halves, of v (the first
    # `halves` steps) or of k, its inputs in slot i % 2.
    halves = key_dim // HALF
    num_steps = 2 * halves

    def body(vectors, G_smem, akk, inverse_smem, x_buffers, cotangent_buffers, products,
             barriers):
        # products: dT (then dAkk) and a step's bf16 right-hand side, then a step's float32
        # output.
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

        def x_loaded(slot):
            return barriers.at[len(inputs) + slot]

        def cotangent_loaded(slot):
            return barriers.at[len(inputs) + 2 + slot]

        def load_inputs(indices):
            for index in indices:
                source, target = inputs[index]
                plgpu.copy_gmem_to_smem(source, target, barriers.at[index])

        def load_step_inputs(index):
            """Step index's 64 columns of v and dU or of k and dW, into the step's slot of two."""
            keys = pl.ds(HALF * (index % halves), HALF)
            slot = index % 2

            def load(x_source, cotangent_source):
                plgpu.copy_gmem_to_smem(x_source, x_buffers.at[slot], x_loaded(slot))
                plgpu.copy_gmem_to_smem(cotangent_source.at[(*out, slice(None), keys)],
                                        cotangent_buffers.at[slot], cotangent_loaded(slot))

            lax.cond(index >= halves,
                     lambda: load(k_gmem.at[batch, tokens, head // group, keys], dw_gmem),
                     lambda: load(v_gmem.at[batch, tokens, head, keys], du_gmem))

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
        # The v steps' factors where the k steps have k's inverse norm and E reads: multiplying by
        # one is exact, so both parts share one code path.
        ones_of_row = plgpu.layout_cast(jnp.ones((CHUNK,), jnp.float32), ROW_VECTOR)
        ones = plgpu.layout_cast(jnp.ones(half_shape, jnp.float32), WGMMA)

        def decay_read(keys):  # E reads, recomputed where needed rather than held in registers
            return jnp.exp(load_plain(G_smem.at[:, keys])) * reads_state

        def gradients(d_inverse):
            def step(index, dbeta):  # rolled (the module docstring says why)
                is_k = index >= halves
                keys = pl.ds(HALF * (index % halves), HALF)
                slot = index % 2
                x_smem, cotangent = x_buffers.at[slot], cotangent_buffers.at[slot]

                plgpu.barrier_wait(x_loaded(slot))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's output is read

                @pl.when(index == halves)
                def _():
                    plgpu.barrier_wait(k_factor_loaded)
                    plgpu.barrier_wait(G_loaded)

                k_factor = lax.cond(is_k, lambda: plgpu.load(k_factor_smem, layout=ROW_VECTOR),
                                    lambda: ones_of_row)

                def load_x():  # v, or k normalised
                    x = plgpu.load(x_smem, layout=WGMMA).astype(jnp.float32)
                    return x * per_row(k_factor, half_shape)

                def decay():  # E reads (k) or ones (v)
                    return lax.cond(is_k, lambda: decay_read(keys), lambda: ones)

                rhs[...] = (beta * load_x() * decay()).astype(OPERAND_DTYPE)
                plgpu.commit_smem()
                plgpu.barrier_wait(cotangent_loaded(slot))
                plgpu.wgmma(d_inverse, cotangent, rhs.transpose((1, 0)))

                @pl.when(index == 0)
                def _():
                    plgpu.barrier_wait(inverse_loaded)

                d_rhs = matmul_of_splits(inverse_t, (cotangent,), half_shape)
                # Each part's products and their sum in one branch: the compiler may fuse a product
                # with its addition (FMA), and a product by one in between would round v's first.
                dbeta = dbeta + lax.cond(
                    is_k, lambda: jnp.sum(d_rhs * load_x() * decay_read(keys), axis=1),
                    lambda: jnp.sum(d_rhs * load_x(), axis=1))
                output = beta * decay() * d_rhs

                def store_dv():  # over rhs_v (its product is done)
                    rhs[...] = output.astype(rhs.dtype)

                def store_dk():
                    out_staging[...] = output

                lax.cond(is_k, store_dk, store_dv)
                # Also: x is read (and the cotangent by the products) before TMA reuses the slot.
                plgpu.commit_smem()

                @pl.when(index + 2 < num_steps)
                def _():
                    load_step_inputs(index + 2)

                lax.cond(is_k,
                         lambda: plgpu.copy_smem_to_gmem(
                             out_staging, dk_wy_gmem.at[(*out, slice(None), keys)]),
                         lambda: plgpu.copy_smem_to_gmem(
                             rhs, dv_gmem.at[batch, tokens, head, keys]))
                return dbeta

            # -0.0 + x is x for every x (0.0 + -0.0 is not): dbeta is the plain sum of the terms.
            no_terms = plgpu.layout_cast(jnp.full((CHUNK,), -0.0, jnp.float32), ROW_VECTOR)
            dbeta = lax.fori_loop(0, num_steps, step, no_terms)
            return d_inverse[...], dbeta

        dT, dbeta = pl.run_scoped(gradients, plgpu.ACC(scores_shape))

        # dN = -T^T dT T^T on the entries N has (strict lower, same document); dAkk = beta dN.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's output is read
        dT_smem[...] = dT.astype(OPERAND_DTYPE)
        plgpu.commit_smem()
        # The first product is the second's left operand in registers (no store, no barrier).
        product = matmul(inverse_t[0], dT_smem, scores_shape).astype(OPERAND_DTYPE)
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

    # Shared memory: buffers with disjoint lifetimes share one memory (`plgpu.RefUnion`, so that
    # interpret mode's race detection checks the reuse), and each input is awaited where it is
    # first read. The right-hand sides run in 64-column steps (the dU or dW slice, bf16 as given,
    # and the v or k columns in one of two slots, the step after next's loading while a step
    # computes; the wgmmas read the cotangent where TMA put it), so only G spans all of K.
    tile = swizzled_smem(half_shape, OPERAND_DTYPE)  # [C, 64] = [C, C] bf16
    pl.run_scoped(
        body,
        plgpu.SMEM((D_BETA + 1, CHUNK), jnp.float32),  # the vectors (rows above)
        plgpu.SMEM((CHUNK, key_dim), jnp.float32),  # G (plain rows: read by column halves)
        tile,  # Akk
        swizzled_smem((2, *scores_shape), OPERAND_DTYPE),  # T's hi and lo parts
        swizzled_smem((2, *half_shape), OPERAND_DTYPE),  # two steps' v or k columns
        swizzled_smem((2, *half_shape), OPERAND_DTYPE),  # two steps' dU or dW columns
        plgpu.RefUnion((tile, tile), swizzled_smem(half_shape, jnp.float32)),
        plgpu.Barrier(num_barriers=10),
    )


def _inverse_norms(x, use_qk_l2norm, padded_length):
    """float32 [B, H, T']: `rsqrt(sum(x^2) + eps)` per token and head (ones without the norm)."""
    x = x.astype(jnp.float32)
    if use_qk_l2norm:
        factor = lax.rsqrt(jnp.sum(x * x, axis=-1) + L2_NORM_EPS)
    else:
        factor = jnp.ones(x.shape[:-1], jnp.float32)
    factor = jnp.pad(factor, ((0, 0), (0, padded_length - x.shape[1]), (0, 0)))
    return jnp.moveaxis(factor, 1, 2)


@lowered_once("scale", "use_qk_l2norm", "gate_lower_bound")
def prepare_chunks_vjp_kernel(q, k, v, g, beta, *, scale, segment_ids, use_qk_l2norm,
                              gate_lower_bound, residuals: PreparationResiduals,
                              cotangents: ChunkedInputs):
    """The VJP of `kda.chunked.prepare_chunks` (chunk 64, bounded gates) by kernel 1,
    `score_backward` and, for the L2 norm of q and k without grouped heads, `l2_norm_vjp_kernel`.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V] (K = V in {64, 128}); g: [B, T, HV, K], every
        g >= gate_lower_bound; beta: [B, T, HV].
      scale, segment_ids, use_qk_l2norm: as in `kda.chunked.chunk_kda`.
      gate_lower_bound: L in [-5, 0).
      residuals: what the preparation kernel saved for its backward on these inputs
        (`kda.kernels.mosaic_gpu.prepare.prepare_chunks_kernel` with `save_for_backward`).
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
        kernel_body(_wy_backward_kernel, group=group),
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

    dq, dk, dg = score_backward(q_bf16, k_bf16, residuals.G, document, q_factor, k_factor, dakk,
                                dk_wy, cotangents, lower_bound=lower_bound, group=group)

    # The scale and the L2 norm's backward: one pass each by the kernel, which reads the padded
    # cotangents as they are. Grouped value heads need the sum over each group's value heads
    # first (a reduction of its own), without the norm only the scale and casts remain, and the
    # kernel reads x in bf16 only: `prepare_qk_vjp` does those in XLA.
    if use_qk_l2norm and group == 1 and q.dtype == k.dtype == OPERAND_DTYPE:
        dq = l2_norm_vjp_kernel(q, dq, scale=scale)
        dk = l2_norm_vjp_kernel(k, dk, scale=1.0)
    else:
        dq, dk = prepare_qk_vjp(q, k, dq[:, :length], dk[:, :length], scale=scale,
                                use_qk_l2norm=use_qk_l2norm)
    return (dq, dk, dv[:, :length].astype(v.dtype), dg[:, :length].astype(g.dtype),
            jnp.moveaxis(dbeta, 1, 2)[:, :length].astype(beta.dtype))
