"""The Triton kernels of `kda.kernels.triton` (this module imports triton: load it only to launch).

Both kernels use plain `tl.dot` on bfloat16 tiles with float32 accumulation, which Triton lowers
to mma on any NVIDIA GPU from Ampere on (and to wgmma on Hopper); nothing here needs Hopper.
Every array is contiguous in the layout its docstring gives; offsets are computed from the static
shapes (constexpr), in int64 from the (batch row, head) index on, so large B * T * H do not wrap.
"""

import triton
import triton.language as tl

from kda import common

L2_NORM_EPS = tl.constexpr(common.L2_NORM_EPS)


@triton.jit
def _split_dot(a, b):
    """`a @ b` for float32 a [M, N], b [N, P] from bf16 hi/lo parts of both (lo @ lo dropped)."""
    a_hi = a.to(tl.bfloat16)
    a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
    b_hi = b.to(tl.bfloat16)
    b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
    product = tl.dot(a_hi, b_hi)
    product = tl.dot(a_hi, b_lo, product)
    return tl.dot(a_lo, b_hi, product)


@triton.jit
def _row(matrix, rows, index):
    """Row `index` of a [R, N] register tile, as an [N] vector (registers cannot be indexed)."""
    return tl.sum(tl.where(rows[:, None] == index, matrix, 0.0), 0)


@triton.jit
def prepare_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, segment_ptr,
                   w_ptr, u_ptr, q_state_ptr, k_state_t_ptr, aqk_ptr, decay_ptr,
                   T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                   TILE: tl.constexpr, SCALE: tl.constexpr, LOWER_BOUND: tl.constexpr,
                   USE_QK_L2NORM: tl.constexpr):
    """One (chunk, batch row x value head) program of `kda.chunked.prepare_chunks`, bounded gates.

    Inputs: q, k [B, T, H, K] and v [B, T, HV, V] (bf16), g [B, T, HV, K] and beta [B, T, HV]
    (float32), segment ids [B, T] (int32; all equal when there are no documents). Tokens past T
    read as zeros, as the plain-JAX padding. Outputs, [B, HV, N, ...]: W [C, K] bf16, U [C, V]
    float32, q_from_state [C, K] bf16, k_to_state transposed [K, C] bf16, Aqk [C, C] bf16 and
    chunk_decay [K] float32 (`kda.kernels.mosaic_gpu_common.RecurrenceOperands`).
    """
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // HV
    head = batch_head % HV
    rows = tl.arange(0, CHUNK)
    keys = tl.arange(0, K)
    values = tl.arange(0, V)
    tokens = chunk * CHUNK + rows
    valid = tokens < T
    token_index = batch.to(tl.int64) * T + tokens  # into [B, T]
    head_token = token_index * HV + head  # into [B, T, HV]

    # Documents started inside this chunk up to each token: 0 = the document live at its start.
    segment = tl.load(segment_ptr + token_index, mask=valid, other=0)
    previous = tl.load(segment_ptr + token_index - 1, mask=valid & (tokens > 0), other=0)
    document = tl.cumsum(((segment != previous) & valid & (tokens > 0)).to(tl.int32), 0)
    last_document = tl.max(document, 0)
    reads_state = (document == 0)[:, None]
    writes_state = (document == last_document)[:, None]

    g = tl.load(g_ptr + head_token[:, None] * K + keys[None, :], mask=valid[:, None], other=0.0)
    G = tl.cumsum(g, 0)  # [C, K] chunk-local cumulative log-decay
    last_G = _row(G, rows, CHUNK - 1)
    out_chunk = batch_head.to(tl.int64) * NUM_CHUNKS + chunk  # into [B, HV, N]
    tl.store(decay_ptr + out_chunk * K + keys, tl.where(last_document == 0, tl.exp(last_G), 0.0))

    # Each 16-row tile i is anchored at b_i = G[16 i] + 7.5 L (kda/chunked.py, bounded gates).
    anchor_shift = 0.5 * (TILE - 1) * LOWER_BOUND
    row_tile = rows // TILE
    row_anchor = tl.zeros([CHUNK, K], tl.float32)
    for i in tl.static_range(CHUNK // TILE):
        anchor = _row(G, rows, TILE * i) + anchor_shift
        row_anchor = tl.where((row_tile == i)[:, None], anchor[None, :], row_anchor)
    row_factor = tl.exp(G - row_anchor)  # exponents within [7.5 L, -7.5 L]

    qk_head = head // (HV // H)  # grouped value heads share a q/k head
    qk_offsets = (token_index * H + qk_head)[:, None] * K + keys[None, :]
    q = tl.load(q_ptr + qk_offsets, mask=valid[:, None], other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk_offsets, mask=valid[:, None], other=0.0).to(tl.float32)
    if USE_QK_L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, 1) + L2_NORM_EPS)[:, None]
        k = k * tl.math.rsqrt(tl.sum(k * k, 1) + L2_NORM_EPS)[:, None]
    q = q * SCALE
    decay_from_start = tl.where(reads_state, tl.exp(G), 0.0)
    chunk_keys = out_chunk * CHUNK * K + rows[:, None] * K + keys[None, :]  # into [B, HV, N, C, K]
    tl.store(q_state_ptr + chunk_keys, (q * decay_from_start).to(tl.bfloat16))
    k_to_state = k * tl.where(writes_state, tl.exp(last_G[None, :] - G), 0.0)
    tl.store(k_state_t_ptr + out_chunk * K * CHUNK + keys[None, :] * CHUNK + rows[:, None],
             k_to_state.to(tl.bfloat16))

    # Scores: row tile i times the columns s < 16 (i + 1) scaled by exp(b_i - G_s). Each product
    # runs over all C rows with the other tiles' rows zeroed: 4x the useful work of the score
    # tiles, but registers cannot be sliced into 16-row tiles.
    q_rows = (q * row_factor).to(tl.bfloat16)
    k_rows = (k * row_factor).to(tl.bfloat16)
    qk = tl.zeros([CHUNK, CHUNK], tl.float32)
    kk = tl.zeros([CHUNK, CHUNK], tl.float32)
    for i in tl.static_range(CHUNK // TILE):
        anchor = _row(G, rows, TILE * i) + anchor_shift
        # Later columns get exp(-inf) = 0: their exponents could overflow.
        exponent = tl.where(rows[:, None] < TILE * (i + 1), anchor[None, :] - G, -float("inf"))
        columns = tl.trans((k * tl.exp(exponent)).to(tl.bfloat16))  # [K, C]
        in_tile = (row_tile == i)[:, None]
        qk = tl.dot(tl.where(in_tile, q_rows, 0.0).to(tl.bfloat16), columns, qk)
        kk = tl.dot(tl.where(in_tile, k_rows, 0.0).to(tl.bfloat16), columns, kk)

    same_document = document[:, None] == document[None, :]
    aqk = tl.where((rows[None, :] <= rows[:, None]) & same_document, qk, 0.0)
    chunk_scores = out_chunk * CHUNK * CHUNK + rows[:, None] * CHUNK + rows[None, :]
    tl.store(aqk_ptr + chunk_scores, aqk.to(tl.bfloat16))
    beta = tl.load(beta_ptr + head_token, mask=valid, other=0.0)
    N = tl.where((rows[None, :] < rows[:, None]) & same_document, kk * beta[:, None], 0.0)

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

    # W = (I + N)^-1 (beta k exp(G)), U = (I + N)^-1 (beta v): hi/lo splits, since U is read in
    # float32 and W is rounded only once.
    w = _split_dot(inverse, k * decay_from_start * beta[:, None])
    tl.store(w_ptr + chunk_keys, w.to(tl.bfloat16))
    v = tl.load(v_ptr + head_token[:, None] * V + values[None, :], mask=valid[:, None],
                other=0.0).to(tl.float32)
    u = _split_dot(inverse, v * beta[:, None])
    tl.store(u_ptr + out_chunk * CHUNK * V + rows[:, None] * V + values[None, :], u)


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
