"""The Triton kernels of `kda.kernels.triton.op`; this module imports triton: load it to launch.

The kernels (`scores_kernel` and `solve_kernel` for the chunk preparation, `recurrence_kernel`)
use plain `tl.dot` on bfloat16 tiles with float32 accumulation, which Triton lowers to mma on any
NVIDIA GPU from Ampere on (and to wgmma on Hopper); nothing here needs Hopper. Every array is
contiguous in the layout its docstring gives; offsets are computed from the static shapes
(constexpr), in int64 from the (batch row, head) index on, so large B * T * H do not wrap.
Numerics and register footprints: `kda.kernels.triton.op`.
"""

import triton
import triton.language as tl

from kda import common

L2_NORM_EPS = tl.constexpr(common.L2_NORM_EPS)
COLUMN_BLOCK = tl.constexpr(64)  # columns of q, k, g, W and U handled at once (K, V: 64 or 128)


@triton.jit
def _split(x):
    """float32 x -> (hi, lo) bf16 with hi + lo = x to about 16 mantissa bits."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _split_dot(a_hi, a_lo, b):
    """`a @ b` from a's bf16 parts and float32 b's (the lo @ lo product is negligible)."""
    b_hi, b_lo = _split(b)
    product = tl.dot(a_hi, b_hi)
    product = tl.dot(a_hi, b_lo, product)
    return tl.dot(a_lo, b_hi, product)


@triton.jit
def _row(matrix, rows, index):
    """Row `index` of a [R, N] register tile, as an [N] vector (registers cannot be indexed)."""
    return tl.sum(tl.where(rows[:, None] == index, matrix, 0.0), 0)


@triton.jit
def _pick(vector, selection):
    """`vector [C]` at the positions `selection [R, C]` marks (one per row): [R]."""
    return tl.sum(tl.where(selection, vector[None, :], 0), 1)


@triton.jit
def _load_rows(ptr, offsets, valid):
    """float32 rows [C, N] at `offsets`, zero past T."""
    return tl.load(ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def _inverse_norms(ptr, row_offsets, valid, K: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """[C]: the factors that L2-normalise the rows [C, K] at `row_offsets` (1 without the norm),
    read by 64-column blocks."""
    if not USE_QK_L2NORM:
        return tl.full(valid.shape, 1.0, tl.float32)
    square_norm = tl.zeros(valid.shape, tl.float32)
    for block in tl.static_range(K // COLUMN_BLOCK):
        columns = block * COLUMN_BLOCK + tl.arange(0, COLUMN_BLOCK)
        x = _load_rows(ptr, row_offsets[:, None] + columns[None, :], valid)
        square_norm += tl.sum(x * x, 1)
    return tl.math.rsqrt(square_norm + L2_NORM_EPS)


@triton.jit
def _documents(segment_ptr, token_index, tokens, valid):
    """[C] int32: documents started inside this chunk up to each token (0: the one live at its
    start), from the segment ids [B, T]; tokens past T start none."""
    segment = tl.load(segment_ptr + token_index, mask=valid, other=0)
    previous = tl.load(segment_ptr + token_index - 1, mask=valid & (tokens > 0), other=0)
    return tl.cumsum(((segment != previous) & valid & (tokens > 0)).to(tl.int32), 0)


# The two preparation kernels run one program per (chunk, batch row x value head) on the same
# inputs: q, k [B, T, H, K] and v [B, T, HV, V] in bf16, g [B, T, HV, K] and beta [B, T, HV] in
# float32, segment ids [B, T] int32 (all equal when there are no documents). Tokens past T read as
# zeros, as the plain-JAX padding. Outputs are [B, HV, N, ...]. Two kernels rather than one: the
# scores and the inverse each fill the registers, and together they spilled (ptxas, sm_80/90).


@triton.jit
def _chunk_positions(T, HV, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """Where the program (chunk, batch row x value head) reads and writes: its chunk, batch row and
    value head, the chunk's rows and tokens, which tokens exist (< T), their offsets into [B, T]
    and [B, T, HV], and the chunk's offset into [B, HV, N]."""
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // HV
    head = batch_head % HV
    rows = tl.arange(0, CHUNK)
    tokens = chunk * CHUNK + rows
    valid = tokens < T
    token_index = batch.to(tl.int64) * T + tokens  # into [B, T]
    head_token = token_index * HV + head  # into [B, T, HV]
    out_chunk = batch_head.to(tl.int64) * NUM_CHUNKS + chunk  # into [B, HV, N]
    return chunk, batch, head, rows, tokens, valid, token_index, head_token, out_chunk


@triton.jit
def scores_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, segment_ptr,
                  q_state_ptr, k_state_t_ptr, aqk_ptr, decay_ptr, unit_lower_ptr,
                  T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                  NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                  SCALE: tl.constexpr, LOWER_BOUND: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """The chunk's scores and state factors (bounded gates), the first half of `prepare_chunks`.

    Outputs: q_from_state [C, K] bf16, k_to_state transposed [K, C] bf16, Aqk [C, C] bf16,
    chunk_decay [K] float32, and N = beta Akk [C, C] bf16 (strictly lower) for `solve_kernel`.
    """
    chunk, batch, head, rows, tokens, valid, token_index, head_token, out_chunk = (
        _chunk_positions(T, HV, NUM_CHUNKS, CHUNK))
    document = _documents(segment_ptr, token_index, tokens, valid)
    last_document = tl.max(document, 0)

    qk_rows = (token_index * H + head // (HV // H)) * K  # grouped heads share q and k
    q_scale = _inverse_norms(q_ptr, qk_rows, valid, K, USE_QK_L2NORM) * SCALE
    k_scale = _inverse_norms(k_ptr, qk_rows, valid, K, USE_QK_L2NORM)

    # By 64-column blocks of K (loops, not unrolled: one block live at a time), so that a block's
    # [C, 64] tiles fit in registers. First the state factors, per column.
    reads_state = (document == 0)[:, None]
    writes_state = (document == last_document)[:, None]
    for block in range(K // COLUMN_BLOCK):
        columns = block * COLUMN_BLOCK + tl.arange(0, COLUMN_BLOCK)
        G = tl.cumsum(_load_rows(g_ptr, head_token[:, None] * K + columns[None, :], valid), 0)
        last_G = _row(G, rows, CHUNK - 1)
        tl.store(decay_ptr + out_chunk * K + columns,
                 tl.where(last_document == 0, tl.exp(last_G), 0.0))
        q = _load_rows(q_ptr, qk_rows[:, None] + columns[None, :], valid) * q_scale[:, None]
        tl.store(q_state_ptr + out_chunk * CHUNK * K + rows[:, None] * K + columns[None, :],
                 (q * tl.where(reads_state, tl.exp(G), 0.0)).to(tl.bfloat16))
        k = _load_rows(k_ptr, qk_rows[:, None] + columns[None, :], valid) * k_scale[:, None]
        k_to_state = k * tl.where(writes_state, tl.exp(last_G[None, :] - G), 0.0)
        tl.store(k_state_t_ptr + out_chunk * K * CHUNK + columns[None, :] * CHUNK + rows[:, None],
                 k_to_state.to(tl.bfloat16))

    # Then the scores by 16-row tiles, each anchored at b = G[first row] + 7.5 L (kda/chunked.py,
    # bounded gates): the tile's rows scaled by exp(G_r - b), the columns s < 16 (tile + 1) by
    # exp(b - G_s); every exponent of the diagonal tile lies within [7.5 L, -7.5 L].
    anchor_shift = 0.5 * (TILE - 1) * LOWER_BOUND
    beta = tl.load(beta_ptr + head_token, mask=valid, other=0.0)
    for tile in range(CHUNK // TILE):
        tile_rows = tile * TILE + tl.arange(0, TILE)  # the tile's rows r in the chunk
        tile_valid = chunk * CHUNK + tile_rows < T
        tile_token = batch.to(tl.int64) * T + chunk * CHUNK + tile_rows  # into [B, T]
        in_tile = rows[None, :] == tile_rows[:, None]  # [16, C]: the tile's entries of a [C]
        qk = tl.zeros([TILE, CHUNK], tl.float32)
        kk = tl.zeros([TILE, CHUNK], tl.float32)
        for block in range(K // COLUMN_BLOCK):
            columns = block * COLUMN_BLOCK + tl.arange(0, COLUMN_BLOCK)
            G = tl.cumsum(_load_rows(g_ptr, head_token[:, None] * K + columns[None, :], valid), 0)
            anchor = _row(G, rows, tile * TILE) + anchor_shift
            # The tile's rows of G: its own cumulative sum on the row before it (0 for tile 0).
            tile_g = _load_rows(g_ptr, (tile_token * HV + head)[:, None] * K + columns[None, :],
                                tile_valid)
            tile_G = _row(G, rows, tile * TILE - 1)[None, :] + tl.cumsum(tile_g, 0)
            row_factor = tl.exp(tile_G - anchor[None, :])
            tile_qk = (tile_token * H + head // (HV // H))[:, None] * K + columns[None, :]
            q_rows = _load_rows(q_ptr, tile_qk, tile_valid) * _pick(q_scale, in_tile)[:, None]
            k_rows = _load_rows(k_ptr, tile_qk, tile_valid) * _pick(k_scale, in_tile)[:, None]
            # Later columns get exp(-inf) = 0: their exponents could overflow.
            exponent = tl.where(rows[:, None] < (tile + 1) * TILE, anchor[None, :] - G,
                                -float("inf"))
            k = _load_rows(k_ptr, qk_rows[:, None] + columns[None, :], valid) * k_scale[:, None]
            scaled_columns = tl.trans((k * tl.exp(exponent)).to(tl.bfloat16))  # [64, C]
            qk = tl.dot((q_rows * row_factor).to(tl.bfloat16), scaled_columns, qk)
            kk = tl.dot((k_rows * row_factor).to(tl.bfloat16), scaled_columns, kk)

        same_document = _pick(document, in_tile)[:, None] == document[None, :]
        tile_scores = out_chunk * CHUNK * CHUNK + tile_rows[:, None] * CHUNK + rows[None, :]
        aqk = tl.where((rows[None, :] <= tile_rows[:, None]) & same_document, qk, 0.0)
        tl.store(aqk_ptr + tile_scores, aqk.to(tl.bfloat16))
        unit_lower = tl.where((rows[None, :] < tile_rows[:, None]) & same_document,
                              kk * _pick(beta, in_tile)[:, None], 0.0)
        tl.store(unit_lower_ptr + tile_scores, unit_lower.to(tl.bfloat16))


@triton.jit
def solve_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, segment_ptr, unit_lower_ptr,
                 w_ptr, u_ptr,
                 T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                 USE_QK_L2NORM: tl.constexpr):
    """The UT transform, the second half of `prepare_chunks`: with N from `scores_kernel`,
    W = (I + N)^-1 (beta k exp(G)) [C, K] bf16 and U = (I + N)^-1 (beta v) [C, V] float32."""
    chunk, batch, head, rows, tokens, valid, token_index, head_token, out_chunk = (
        _chunk_positions(T, HV, NUM_CHUNKS, CHUNK))
    N = tl.load(unit_lower_ptr + out_chunk * CHUNK * CHUNK + rows[:, None] * CHUNK
                + rows[None, :]).to(tl.float32)

    # (I + N)^-1 by recursive doubling: with X the inverse of the b-block diagonal part,
    # X <- X - X C X, where C holds N's entries linking neighbouring b-blocks of a 2b-block.
    # Every X is a block of the true inverse, so nothing grows as powers of N would.
    distance = rows[:, None] ^ rows[None, :]  # b <= distance < 2b: neighbouring b-blocks
    inverse = tl.where(distance == 0, 1.0, 0.0) - tl.where(distance < 2, N, 0.0)
    for level in tl.static_range(1, CHUNK.bit_length() - 1):
        block = 1 << level
        link = tl.where((distance >= block) & (distance < 2 * block), N, 0.0).to(tl.bfloat16)
        inverse_operand = inverse.to(tl.bfloat16)
        product = tl.dot(inverse_operand, link).to(tl.bfloat16)
        inverse = inverse - tl.dot(product, inverse_operand)

    # hi/lo splits of both factors, since U is read in float32 and W is rounded only once. By
    # 64-column blocks, so that a block's [C, 64] tiles fit in registers.
    inverse_hi, inverse_lo = _split(inverse)
    beta = tl.load(beta_ptr + head_token, mask=valid, other=0.0)
    reads_state = (_documents(segment_ptr, token_index, tokens, valid) == 0)[:, None]
    key_rows = (token_index * H + head // (HV // H)) * K  # grouped heads share k
    key_factor = beta * _inverse_norms(k_ptr, key_rows, valid, K, USE_QK_L2NORM)
    for block in range(K // COLUMN_BLOCK):
        columns = block * COLUMN_BLOCK + tl.arange(0, COLUMN_BLOCK)
        # (A loop, not unrolled: one block live at a time.) G again as the cumulative sum of g:
        # per column, the same sums as in `scores_kernel`.
        G = tl.cumsum(_load_rows(g_ptr, head_token[:, None] * K + columns[None, :], valid), 0)
        rhs = (_load_rows(k_ptr, key_rows[:, None] + columns[None, :], valid)
               * tl.where(reads_state, tl.exp(G), 0.0) * key_factor[:, None])
        tl.store(w_ptr + out_chunk * CHUNK * K + rows[:, None] * K + columns[None, :],
                 _split_dot(inverse_hi, inverse_lo, rhs).to(tl.bfloat16))
    for block in range(V // COLUMN_BLOCK):
        columns = block * COLUMN_BLOCK + tl.arange(0, COLUMN_BLOCK)
        v_block = _load_rows(v_ptr, head_token[:, None] * V + columns[None, :], valid)
        tl.store(u_ptr + out_chunk * CHUNK * V + rows[:, None] * V + columns[None, :],
                 _split_dot(inverse_hi, inverse_lo, v_block * beta[:, None]))


@triton.jit
def recurrence_kernel(w_ptr, u_ptr, q_ptr, kt_ptr, aqk_ptr, decay_ptr, initial_state_ptr,
                      o_ptr, final_state_ptr,
                      NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BLOCK_V: tl.constexpr):
    """One (V tile, batch row x value head) program of `kda.chunked.chunk_recurrence`.

    Inputs ([B, HV, N, ...], `RecurrenceOperands`): W, q_from_state [C, K], k_to_state^T [K, C]
    and Aqk [C, C] in bf16; U [C, V] and chunk_decay [K] in float32; the initial state
    [B, HV, K, V] in float32. Outputs: o [B, HV, N, C, V] and the final state (float32).
    The state tile S [K, BLOCK_V] stays in float32 registers; per chunk

        V_new = U - W S,   O = q_from_state S + Aqk V_new,   S = decay * S + k_to_state^T V_new

    with S and V_new rounded to bf16 as matmul operands (as the Mosaic GPU kernel does).
    """
    v_tile = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, CHUNK)
    keys = tl.arange(0, K)
    columns = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    state_offsets = batch_head * K * V + keys[:, None] * V + columns[None, :]
    state = tl.load(initial_state_ptr + state_offsets)
    chunk_keys = rows[:, None] * K + keys[None, :]
    chunk_values = rows[:, None] * V + columns[None, :]
    for n in range(NUM_CHUNKS):
        chunk = batch_head * NUM_CHUNKS + n
        w = tl.load(w_ptr + chunk * CHUNK * K + chunk_keys)
        q = tl.load(q_ptr + chunk * CHUNK * K + chunk_keys)
        kt = tl.load(kt_ptr + chunk * K * CHUNK + keys[:, None] * CHUNK + rows[None, :])
        aqk = tl.load(aqk_ptr + chunk * CHUNK * CHUNK + rows[:, None] * CHUNK + rows[None, :])
        u = tl.load(u_ptr + chunk * CHUNK * V + chunk_values)
        decay = tl.load(decay_ptr + chunk * K + keys)
        state_operand = state.to(tl.bfloat16)
        v_new = (u - tl.dot(w, state_operand)).to(tl.bfloat16)
        o = tl.dot(aqk, v_new, tl.dot(q, state_operand))
        tl.store(o_ptr + chunk * CHUNK * V + chunk_values, o.to(o_ptr.dtype.element_ty))
        state = tl.dot(kt, v_new, state * decay[:, None])
    tl.store(final_state_ptr + state_offsets, state)
