"""KDA's chunk preparation with bounded gates: a Pallas Mosaic GPU kernel (Hopper).

`prepare_chunks_kernel` replaces `kda.chunked.prepare_chunks` when `gate_lower_bound = L` is set
and writes the recurrence kernel's `RecurrenceOperands` [B, HV, N, ...]: W, U, q_from_state
[C, K], k_to_state^T [K, C], Aqk [C, C], chunk_decay [K]. One program (one warpgroup) per (batch
row, value head, chunk of C = 64 tokens) loads the chunk's q, k (of its q/k head), v, g, beta
(and packed documents' index) by TMA and computes, from the blocks of
`kda.kernels.mosaic_gpu.tiles` (the algorithm: `docs/kda_chunked.md`):

1. L2 norm and scale of q and k.
2. `G = cumsum(g)` to float32 accuracy: a compensated scan, a thread a column, at K = 128
   (`scanned_cumulative_sum`); at K = 64, where half the threads would idle, `tril(1) @ g` on an
   exact 3-way bf16 split (`cumulative_sum`).
3. The scores `A[r, s] = sum_c x_r[c] k_s[c] exp(G_r[c] - G_s[c])` (x = q for Aqk, k for
   Akk), each 16x16 tile a bf16 product around its row tile's causal anchor
   `b_i = G[16 i] + 7.5 L`: rows scaled by `exp(G_r - b_i)`, columns by `exp(b_i - G_s)`. The
   anchor cancels in every product and keeps the factors within e^37.5 (far inside bf16's
   range); only weights below e^-49 underflow. Transposed (`transposed_scores`), so that wgmma's
   fixed M = 64 runs over the columns.
4. Masks (causal, documents), `N = beta Akk`, `(I + N)^-1` by recursive doubling of the diagonal
   blocks (`unit_lower_inverse`: stable, where a Neumann series is not).
5. `W = T (k exp(G))` and `U = T v`, `T = (I + N)^-1 diag(beta)`: beta joins the shared left
   factor, so v is U's right-hand side as loaded, exact in bf16.
With `save_for_backward` (static) it also writes `PreparationResiduals` (G, Akk masked without
beta, `(I + N)^-1` as a bf16 hi/lo pair: 4 C K + 6 C^2 bytes a chunk), so that its backward,
`kda.kernels.mosaic_gpu.prepare_backward`, recomputes nothing of the forward.

Numerics: bf16 wgmma operands (W from hi/lo splits of both factors, U of T), float32 accumulation
and elementwise math (exp, rsqrt approximate to a few ulp). U (bf16 would raise o's error for little
gain) and chunk_decay are written in float32, the rest in bf16. Against the oracle: o within
3.2e-3, the final state within 2.0e-3 relative error (interpret mode, K = 64, 128; fla's bar 5e-3).

Design: wgmma's left operands computed in registers stay there (no store and barrier for each);
buffers with disjoint lifetimes share SMEM (the scratch at the end of `_prepare_kernel`), so two
programs share an SM at K = 128 and one's TMA traffic overlaps the other's math.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.common import L2_NORM_EPS
from kda.kernels.mosaic_gpu.common import (OPERAND_DTYPE, PreparationResiduals,
                                           RecurrenceOperands, kernel_body, lowered_once,
                                           swizzled_smem)
from kda.kernels.mosaic_gpu.tiles import (CHUNK, COLUMN_VECTOR, COMPILER_PARAMS,
                                          WARPGROUP_THREADS, WGMMA, cumulative_sum,
                                          documents_in_chunk, iota, load_plain,
                                          matmul_of_splits, pad_to_chunks, per_column, per_row,
                                          row_anchors, same_document, scanned_cumulative_sum,
                                          split_bf16, StateMasks, state_masks, store_lower_ones,
                                          store_split, transposed_scores, unit_lower_inverse)


def _prepare_kernel(q_gmem, k_gmem, v_gmem, g_gmem, beta_gmem, *gmems, scale, use_qk_l2norm,
                    lower_bound, group, packed_documents):
    """The body of one (batch row, value head, chunk) program; see the module docstring.

    GMEM inputs: q, k [B, T, H, K] and v [B, T, HV, V] in bf16; g [B, T, HV, K], beta [B, HV, T]
    and, with `packed_documents`, document [B, T] (`documents_in_chunk`) in float32; T is a
    multiple of 64 and K = V. Outputs: the fields of `RecurrenceOperands`, [B, HV, N, ...], then,
    when a backward will run, those of `PreparationResiduals` (their presence is the static flag).
    """
    document_gmem = gmems[0] if packed_documents else None
    (w_gmem, u_gmem, q_state_gmem, k_state_t_gmem, aqk_gmem, decay_gmem,
     *residual_gmems) = gmems[packed_documents:]
    key_dim, value_dim = q_gmem.shape[-1], v_gmem.shape[-1]
    batch, head, chunk = (lax.axis_index(axis) for axis in ("batch", "heads", "chunks"))
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    out = (batch, head, chunk)
    keys_shape, scores_shape = (CHUNK, key_dim), (CHUNK, CHUNK)
    residuals = PreparationResiduals(*residual_gmems) if residual_gmems else None

    def body(q_smem, k_union, g_union, rows_union, beta_smem, document_smem, decay_smem,
             barriers):
        # Each union's groups are used one after another (the scratch at the end, below).
        k_smem, k_state_t_smem, v_smem = k_union
        g_smem, g_parts = g_union
        (g_part, ones), (q_rows, k_rows), score_tiles = rows_union
        aqk, unit_lower, inverse_smem = score_tiles[:3]
        akk_smem = score_tiles[3] if residuals else None
        # g first: the cumulative sum runs while the other inputs arrive.
        inputs = ((g_gmem.at[batch, tokens, head], g_smem),
                  (q_gmem.at[batch, tokens, head // group], q_smem),
                  (k_gmem.at[batch, tokens, head // group], k_smem),
                  (beta_gmem.at[batch, head, tokens], beta_smem))
        if packed_documents:
            inputs += ((document_gmem.at[batch, tokens], document_smem),)
        for index, (source, target) in enumerate(inputs):
            plgpu.copy_gmem_to_smem(source, target, barriers.at[index])

        def loaded(smem):
            return plgpu.load(smem, layout=WGMMA).astype(jnp.float32)

        def inverse_norms(x, times=1.0):
            """[C, K] -> each row's `times / |x_r|` (broadcast over its columns), or `times`."""
            if not use_qk_l2norm:
                return times
            return per_row(lax.rsqrt(jnp.sum(x * x, axis=1) + L2_NORM_EPS) * times, x.shape)

        # 1-2. G in g's place (for row reads): a scan at K = 128, else tril(1) @ (hi + mid + lo).
        scanned = key_dim == WARPGROUP_THREADS
        if not scanned:
            store_lower_ones(ones)
        plgpu.barrier_wait(barriers.at[0])
        if scanned:
            G = scanned_cumulative_sum(g_smem)
        else:
            g = load_plain(g_smem)
            plgpu.commit_smem()  # every thread has read g before the parts overwrite it
            G = cumulative_sum(g, (*g_parts, g_part), ones)
            g_smem[...] = G
            plgpu.commit_smem()
        for index in range(1, len(inputs)):
            plgpu.barrier_wait(barriers.at[index])
        # One document a row: every row reads and writes the state, no score crosses documents
        # (the factors 1.0 and True compile away).
        masks = (state_masks(document_smem, keys_shape) if packed_documents
                 else StateMasks(reads_state=1.0, writes_state=1.0, keeps_state=1.0))
        if residuals:  # read by TMA before step 5 overwrites it (the wait in 3b)
            plgpu.copy_smem_to_gmem(g_smem, residuals.G.at[out])
        last_G = plgpu.load(g_smem.at[CHUNK - 1], layout=COLUMN_VECTOR)
        decay_smem[...] = jnp.exp(last_G) * masks.keeps_state

        # 3a. Row factors exp(G_r - b_tile(r)), and the outputs that need q and k once.
        row_factor = jnp.exp(G - row_anchors(g_smem, keys_shape, lower_bound))
        q = loaded(q_smem)
        q = q * inverse_norms(q, scale)  # the scale joins the norms: one product, not two
        q_rows[...] = (q * row_factor).astype(OPERAND_DTYPE)
        q_smem[...] = (q * jnp.exp(G) * masks.reads_state).astype(OPERAND_DTYPE)  # q_from_state
        k = loaded(k_smem)
        k_norms = inverse_norms(k)  # kept for W's right-hand side: k is loaded again, not reduced
        k = k * k_norms
        k_rows[...] = (k * row_factor).astype(OPERAND_DTYPE)
        k_to_state = k * jnp.exp(per_column(last_G, keys_shape) - G) * masks.writes_state
        plgpu.commit_smem()  # every thread has read k before k_to_state^T overwrites it
        k_state_t_smem.transpose((1, 0))[...] = k_to_state.astype(OPERAND_DTYPE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, q_state_gmem.at[out])
        plgpu.copy_smem_to_gmem(k_state_t_smem, k_state_t_gmem.at[out])
        plgpu.copy_smem_to_gmem(decay_smem, decay_gmem.at[out])

        # 3b. Transposed scores ([s, r] layout: the column index is the row r of A), then masked.
        qk_t, kk_t = transposed_scores(k, G, g_smem, (q_rows, k_rows), lower_bound)
        # k again and v, for step 5, load into q's and k's buffers while the inverse is computed,
        # once the stores above have read them: all but chunk_decay's, issued last (G's, if any,
        # was issued first). The scores gave them that time.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        reloads = ((k_gmem.at[batch, tokens, head // group], q_smem),
                   (v_gmem.at[batch, tokens, head], v_smem))
        for index, (source, target) in enumerate(reloads, start=len(inputs)):
            plgpu.copy_gmem_to_smem(source, target, barriers.at[index])
        rows, columns = iota(scores_shape, 0), iota(scores_shape, 1)
        in_document = same_document(document_smem) if packed_documents else True
        aqk.transpose((1, 0))[...] = jnp.where((columns >= rows) & in_document, qk_t,
                                               0.0).astype(OPERAND_DTYPE)
        akk_t = jnp.where((columns > rows) & in_document, kk_t, 0.0)  # strictly lower
        if residuals:
            akk_smem.transpose((1, 0))[...] = akk_t.astype(OPERAND_DTYPE)
        beta_of_column = plgpu.load(beta_smem, layout=COLUMN_VECTOR)
        unit_lower.transpose((1, 0))[...] = (  # N
            akk_t * per_column(beta_of_column, scores_shape)).astype(OPERAND_DTYPE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(aqk, aqk_gmem.at[out])
        if residuals:
            plgpu.copy_smem_to_gmem(akk_smem, residuals.Akk.at[out])

        # 4. (I + N)^-1 by recursive doubling of the inverted diagonal blocks.
        inverse = unit_lower_inverse(unit_lower, (unit_lower, inverse_smem))  # N's
        # buffer serves as the link: the inverse reads N into registers before writing a link.

        # 5. W = T (k exp(G) reads) and U = T v with T = (I + N)^-1 diag(beta) (module
        # docstring), T and k exp(G) as hi/lo parts: W is rounded only once. beta is read again
        # rather than kept in registers through the inverse.
        if residuals:  # the backward reads (I + N)^-1 itself, in N's buffer and the inverse's
            store_split((inverse_smem, unit_lower), inverse)
            plgpu.commit_smem()
            for index, part in enumerate((inverse_smem, unit_lower)):
                plgpu.copy_smem_to_gmem(part, residuals.inverse.at[(*out, index)])
        beta_of_column = plgpu.load(beta_smem, layout=COLUMN_VECTOR)
        factor_parts = split_bf16(inverse * per_column(beta_of_column, scores_shape), 2)
        for index in range(len(inputs), len(inputs) + len(reloads)):
            plgpu.barrier_wait(barriers.at[index])
        # k (loaded again) and G are read again rather than kept in registers through the solve.
        k_rhs = loaded(q_smem) * k_norms * jnp.exp(load_plain(g_smem)) * masks.reads_state
        plgpu.commit_smem()  # every thread has read G before the parts overwrite it
        store_split(g_parts, k_rhs)
        plgpu.commit_smem()
        w = matmul_of_splits(factor_parts, g_parts, keys_shape).astype(OPERAND_DTYPE)
        u = matmul_of_splits(factor_parts, (v_smem,), (CHUNK, value_dim))
        q_smem[...] = w  # over k's reload, and U over the parts: both products are done
        g_smem[...] = u
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, w_gmem.at[out])
        plgpu.copy_smem_to_gmem(g_smem, u_gmem.at[out])
        plgpu.wait_smem_to_gmem(0)

    # Shared memory, as Mosaic GPU allocates it (with its 2 KiB reduction scratch and 1 KiB
    # alignment): 101 KiB a program at K = V = 128, with or without the residuals, and 61 KiB at
    # 64 (69 with them). An SM has 228 KiB and reserves 1 KiB a program, and its 64K registers
    # allow two warpgroups at up to 255 registers a thread: so two programs share an SM at K = 128
    # and, at most 168 registers a thread, three at 64. For that, buffers whose lifetimes do not
    # overlap share memory (`plgpu.RefUnion`, whose groups are used one after another), and k is
    # read from GMEM twice (its second load and v's run during the inverse): keeping W's
    # right-hand side from step 3 in G's buffer instead keeps more registers live through the
    # scores and is slower. An output's buffer is reused only after its TMA store has read it,
    # and a buffer read into registers in one layout is overwritten in another only after a
    # warpgroup barrier (`commit_smem`).
    operand = lambda shape: swizzled_smem(shape, OPERAND_DTYPE)  # noqa: E731
    pl.run_scoped(
        body,
        # q, then q_from_state, k again and W.
        operand(keys_shape),
        # k, then k_to_state^T and v.
        plgpu.RefUnion(operand(keys_shape), operand((key_dim, CHUNK)),
                       operand((CHUNK, value_dim))),
        # g, then G, then U (plain rows: read one by one); the float32 bits hold two bf16
        # operands in between: parts of g, then of k exp(G).
        plgpu.RefUnion(plgpu.SMEM(keys_shape, jnp.float32),
                       (operand(keys_shape), operand(keys_shape))),
        # The cumulative sum's third part and its triangle, then the scores' scaled rows, then
        # Aqk, N and the inverse's buffer (then its parts), and Akk when a backward will run.
        plgpu.RefUnion((operand(keys_shape), operand(scores_shape)),
                       (operand(keys_shape), operand(keys_shape)),
                       tuple(operand(scores_shape) for _ in range(4 if residuals else 3))),
        plgpu.SMEM((CHUNK,), jnp.float32),  # beta
        plgpu.SMEM((CHUNK,), jnp.float32),  # document
        plgpu.SMEM((key_dim,), jnp.float32),  # chunk_decay
        plgpu.Barrier(num_barriers=7),
    )


@lowered_once("scale", "use_qk_l2norm", "gate_lower_bound", "save_for_backward")
def prepare_chunks_kernel(q, k, v, g, beta, *, scale, segment_ids, use_qk_l2norm,
                          gate_lower_bound, save_for_backward=False):
    """`kda.chunked.prepare_chunks` (chunk 64, bounded gates) by the Mosaic GPU kernel.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V] (bf16, K = V in {64, 128}); g: [B, T, HV, K], every
        g >= gate_lower_bound; beta: [B, T, HV].
      scale, segment_ids, use_qk_l2norm: as in `kda.chunked.chunk_kda`.
      gate_lower_bound: L in [-5, 0).
      save_for_backward: also write what the backward's kernels read
        (`kda.kernels.mosaic_gpu.prepare_backward`); the forward alone does not pay the stores.
    Returns:
      `RecurrenceOperands` [B, HV, N, ...], N = ceil(T / 64); with `save_for_backward`,
      (`RecurrenceOperands`, `PreparationResiduals`).
    """
    batch, length, num_value_heads, value_dim = v.shape
    key_dim = q.shape[-1]
    num_chunks = -(-length // CHUNK)
    padded_length = num_chunks * CHUNK

    padded = functools.partial(pad_to_chunks, padded_length=padded_length)
    chunked = lambda dtype, *tail: jax.ShapeDtypeStruct(  # noqa: E731
        (batch, num_value_heads, num_chunks, *tail), dtype)
    operands_type = RecurrenceOperands(
        W=chunked(OPERAND_DTYPE, CHUNK, key_dim), U=chunked(jnp.float32, CHUNK, value_dim),
        q_from_state=chunked(OPERAND_DTYPE, CHUNK, key_dim),
        k_to_state_t=chunked(OPERAND_DTYPE, key_dim, CHUNK),
        Aqk=chunked(OPERAND_DTYPE, CHUNK, CHUNK), chunk_decay=chunked(jnp.float32, key_dim))
    residuals_type = PreparationResiduals(
        G=chunked(jnp.float32, CHUNK, key_dim), Akk=chunked(OPERAND_DTYPE, CHUNK, CHUNK),
        inverse=chunked(OPERAND_DTYPE, 2, CHUNK, CHUNK)) if save_for_backward else ()
    run = plgpu.kernel(
        kernel_body(_prepare_kernel, scale=float(scale), use_qk_l2norm=use_qk_l2norm,
                    lower_bound=float(gate_lower_bound), group=num_value_heads // q.shape[2],
                    packed_documents=segment_ids is not None),
        out_type=(*operands_type, *residuals_type),
        grid=(batch, num_value_heads, num_chunks),
        grid_names=("batch", "heads", "chunks"),
        compiler_params=COMPILER_PARAMS,
    )
    # Without segment ids the kernel reads no document index: its masks are constants.
    documents = (() if segment_ids is None
                 else (documents_in_chunk(segment_ids, batch, padded_length),))
    outputs = run(padded(q, OPERAND_DTYPE), padded(k, OPERAND_DTYPE), padded(v, OPERAND_DTYPE),
                  padded(g, jnp.float32), jnp.moveaxis(padded(beta, jnp.float32), 1, 2),
                  *documents)
    operands = RecurrenceOperands(*outputs[:len(operands_type)])
    if save_for_backward:
        return operands, PreparationResiduals(*outputs[len(operands_type):])
    return operands
