"""Chunk-parallel Kimi Delta Attention in plain JAX (the WY/UT form), exact and differentiable.

Per batch row and value head the sequence is cut into chunks of C = 64 tokens; inside a chunk,
rows r = 0..C-1, `G_r = sum_{t<=r} g_t` is the chunk-local cumulative log-decay [C, K] and `S`
[K, V] the state entering the chunk (derivation: docs/kda_chunked.md):

    Akk[i, j] = beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])     j <  i
    Aqk[i, j] =        sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])     j <= i   (q carries the scale)
    W = (I + Akk)^-1 (beta k exp(G)),     U = (I + Akk)^-1 (beta v)       (the UT transform)
    V_new = U - W S
    O = (q exp(G)) S + Aqk V_new
    S_next = exp(G_last) S + (k exp(G_last - G))^T V_new

Everything but the recurrence over chunks is parallel (`prepare_chunks`); `chunk_recurrence`
carries `S` from chunk to chunk with `lax.scan`, and GPU kernels (`kda.kernels`) replace that part
alone (`chunk_kda_with_recurrence`).

Scores are built in 16x16 tiles. An off-diagonal tile (row tile i > column tile j) is anchored on
the first row of tile i, `a`: `q exp(G - a)` and `k exp(a - G)` both have exponents <= 0, so the
tile is a plain matmul for any gate. A diagonal tile needs `exp(G_r - G_s)` for s <= r:

* bounded gates (`gate_lower_bound = L`, every g >= L >= -5): the causal anchor `a = G_first +
  7.5 L` (fixed by the tile's first token, so appending tokens never moves it) keeps both factors
  within e^(7.5 |L|) <= e^37.5, so the diagonal tile is a matmul too (docs/kda_gate.md);
* any other gate (softplus, unbounded): the exact per-element sum over c of
  `q_r k_s exp(G_r - G_s)`, which never exponentiates a positive number.

Erasing gates (unbounded path only): a gate g <= ERASING_GATE (-104; -1e8 and -inf too) has
exp(g) = 0 in float32, so it wipes its channel of the state. Left in the cumulative sum it would
make G -inf (and -inf - -inf NaN) or, at -1e8, swamp every small gate after it in float32
rounding; even clamped to -104, a run of them leaves G near -104 n, whose float32 spacing (2^-11
at 5000) is then the error of every decay after the run. So such a gate is left out of G, and a
chunk-local count E of the erasing gates so far stands for it: a decay `exp(G_r - G_s)` whose
span (s, r] holds one (E_r != E_s) is exactly 0, the oracle's value (`erasing_cumsum`, `_span`).
The off-diagonal tiles' factors keep the rule: E never decreases, so for the anchor a between s
and r, E_r == E_s exactly when E_r == E_a and E_a == E_s (docs/kda_gate.md).

Packed documents: a token whose segment id differs from its predecessor's starts a new document.
Scores between documents are masked, rows of a document that began inside the chunk do not read
the incoming state, and only the chunk's last document writes the outgoing state.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda.common import document_starts, einsum, pad_tokens, prepare_qk

CHUNK_SIZE = 64
TILE_SIZE = 16
# Gates at or below this erase their channel of the state (unbounded path): exp(-104) ~ 6.8e-46
# is below half of float32's smallest subnormal (2^-149 ~ e^-103.3), so the oracle's exp(g) is 0
# there too, whether or not denormals are flushed (XLA's CPU exp flushes from about -87.3). In
# float64 (finite-difference checks) the neglected decay is at most e^-104 of the state.
ERASING_GATE = -104.0


def tokens_to_chunks(x, chunk_size):
    """[B, N C, HV, ...] -> [B, HV, N, C, ...]: the model's token-major layout cut into chunks."""
    batch, length = x.shape[:2]
    x = x.reshape(batch, length // chunk_size, chunk_size, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)


def chunks_to_tokens(x):
    """[B, HV, N, C, V] -> [B, N C, HV, V]: chunk outputs back in the model's token-major layout."""
    batch, heads, num_chunks, chunk, value_dim = x.shape
    return jnp.moveaxis(x, 1, 3).reshape(batch, num_chunks * chunk, heads, value_dim)


def _tiles(x):
    """[..., C, K] -> [..., C/16, 16, K]."""
    return x.reshape(*x.shape[:-2], x.shape[-2] // TILE_SIZE, TILE_SIZE, x.shape[-1])


def erasing_cumsum(g, axis=-2):
    """The cumulative log-decay without its erasing gates, and the count of those gates.

    Args:
      g: [..., C, K] log-decay, any value <= 0 (-inf included).
    Returns:
      (G, E): G [..., C, K] the inclusive cumsum over `axis` of the gates above ERASING_GATE
      (finite, and never swamped by a -1e8); E int32 [..., C, K] the inclusive count of gates
      <= ERASING_GATE. The decay over the span (s, r] is exp(G_r - G_s) if E_r == E_s, else 0.
    """
    erases = g <= ERASING_GATE
    G = jnp.cumsum(jnp.where(erases, 0.0, g), axis=axis)
    return G, jnp.cumsum(erases, axis=axis, dtype=jnp.int32)


def _span(G_to, G_from, E_to=None, E_from=None):
    """The log-decay from one token to a later one, `G_to - G_from`, or -inf where an erasing
    gate lies between them (`erasing_cumsum`); E None: no erasing gates (bounded path)."""
    if E_to is None:
        return G_to - G_from
    return jnp.where(E_to == E_from, G_to - G_from, -jnp.inf)


def _expand(x, axis):
    """`jnp.expand_dims(x, axis)`, None for None (the bounded path's absent counts)."""
    return None if x is None else jnp.expand_dims(x, axis)


def _off_diagonal_tiles(q, k, G, E=None):
    """Score tiles below the diagonal, anchored on each row tile's first token.

    Args:
      q, k, G: float32 [..., NT, 16, K] (NT tiles per chunk).
      E: int32 [..., NT, 16, K] erasing-gate counts (`erasing_cumsum`), or None.
    Returns:
      (qk, kk): [..., NT, NT, 16, 16], tile (i, j) filled for j < i and zero elsewhere.
    """
    num_tiles = G.shape[-3]
    anchor = G[..., :, :1, :]  # [..., NT(i), 1, K]
    anchor_count = None if E is None else E[..., :, :1, :]
    row_decay = jnp.exp(_span(G, anchor, E, anchor_count))  # exponent <= 0: G never increases
    earlier = jnp.arange(num_tiles)[None, :] < jnp.arange(num_tiles)[:, None]  # [i, j]: j < i
    # [..., NT(i), NT(j), 16, K]; only j < i is kept, so the exponent a_i - G_j is <= 0.
    column_exponent = _span(_expand(anchor, -3), _expand(G, -4), _expand(anchor_count, -3),
                            _expand(E, -4))
    column_decay = jnp.exp(jnp.where(earlier[:, :, None, None], column_exponent, -jnp.inf))
    k_columns = k[..., None, :, :, :] * column_decay
    qk = einsum("...irc,...ijsc->...ijrs", q * row_decay, k_columns)
    kk = einsum("...irc,...ijsc->...ijrs", k * row_decay, k_columns)
    return qk, kk


def _diagonal_tiles_exact(q, k, G, E=None):
    """Diagonal score tiles by the per-element sum; finite for any gate.

    Args:
      q, k, G: float32 [..., NT, 16, K].
      E: int32 [..., NT, 16, K] erasing-gate counts (`erasing_cumsum`), or None.
    Returns:
      (qk, kk): [..., NT, 16, 16], lower triangle including the diagonal (masked by the caller).
    """
    causal = jnp.tril(jnp.ones((TILE_SIZE, TILE_SIZE), bool))
    # [..., NT, r, s, K]: from column s to row r.
    exponent = _span(_expand(G, -2), _expand(G, -3), _expand(E, -2), _expand(E, -3))
    decayed_k = k[..., None, :, :] * jnp.exp(jnp.where(causal[:, :, None], exponent, -jnp.inf))
    # Multiply-and-reduce (not einsum): XLA fuses it into one pass over the [r, s, K] products.
    return (jnp.sum(q[..., :, None, :] * decayed_k, axis=-1),
            jnp.sum(k[..., :, None, :] * decayed_k, axis=-1))


def _diagonal_tiles_bounded(q, k, G, lower_bound):
    """Diagonal score tiles as matmuls around a causal anchor; valid when every g >= lower_bound.

    `G_r - a` and `a - G_s` lie in [7.5 L, -7.5 L] for the anchor `a = G_first + 7.5 L`, so the
    factors are at most e^37.5 for L = -5 and the products e^(G_r - G_s) are recovered exactly.

    Args:
      q, k, G: float32 [..., NT, 16, K].
      lower_bound: L in [-5, 0).
    Returns:
      (qk, kk): [..., NT, 16, 16] (the caller masks the upper triangle).
    """
    anchor = G[..., :1, :] + 0.5 * (TILE_SIZE - 1) * lower_bound
    rows = jnp.exp(G - anchor)
    columns = k * jnp.exp(anchor - G)
    return (einsum("...rc,...sc->...rs", q * rows, columns),
            einsum("...rc,...sc->...rs", k * rows, columns))


def intra_chunk_scores(q, k, G, gate_lower_bound, E=None):
    """The chunk's score matrices, before beta and document masks.

    Args:
      q, k, G: float32 [..., C, K], C a multiple of 16.
      gate_lower_bound: None (exact diagonal tiles) or L in [-5, 0) (matmul diagonal tiles).
      E: int32 [..., C, K] erasing-gate counts (`erasing_cumsum`; unbounded path), or None.
    Returns:
      (Aqk [..., C, C] with j <= i, Akk [..., C, C] with j < i), float32.
    """
    chunk = G.shape[-2]
    q, k, G = _tiles(q), _tiles(k), _tiles(G)
    E = None if E is None else _tiles(E)
    off_qk, off_kk = _off_diagonal_tiles(q, k, G, E)
    if gate_lower_bound is None:
        diag_qk, diag_kk = _diagonal_tiles_exact(q, k, G, E)
    else:
        diag_qk, diag_kk = _diagonal_tiles_bounded(q, k, G, gate_lower_bound)
    num_tiles = G.shape[-3]
    on_diagonal = jnp.eye(num_tiles, dtype=bool)[:, :, None, None]

    def assemble(off, diag):
        blocks = jnp.where(on_diagonal, diag[..., :, None, :, :], off)  # [..., i, j, r, s]
        blocks = jnp.swapaxes(blocks, -3, -2)  # [..., i, r, j, s]
        return blocks.reshape(*blocks.shape[:-4], chunk, chunk)

    inclusive = jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    Aqk = jnp.where(inclusive, assemble(off_qk, diag_qk), 0.0)
    Akk = jnp.where(strict, assemble(off_kk, diag_kk), 0.0)
    return Aqk, Akk


def _invert_unit_lower(A):
    """`(I + A)^-1` for strictly lower-triangular A [..., n, n], by forward substitution."""
    n = A.shape[-1]
    inverse = jnp.broadcast_to(jnp.eye(n, dtype=A.dtype), A.shape)
    for row in range(1, n):  # row i of the inverse: e_i - sum_{j < i} A[i, j] inverse[j]
        inverse = inverse.at[..., row, :].add(-einsum("...j,...jk->...k", A[..., row, :],
                                                      inverse))
    return inverse


def solve_unit_lower(A, rhs):
    """Solves `(I + A) X = rhs` for strictly lower-triangular A, in 16-row blocks.

    Block forward substitution: each diagonal 16x16 block is inverted row by row, then
    `X_i = D_i (rhs_i - sum_{m<i} A_im X_m)`. Exact like a triangular solve, but made of small
    batched matmuls, which XLA runs far faster than its batched triangular solve.

    Args:
      A: [..., C, C], strictly lower triangular, C a multiple of 16.
      rhs: [..., C, N].
    Returns:
      X: [..., C, N].
    """
    num_tiles = A.shape[-1] // TILE_SIZE
    blocks = A.reshape(*A.shape[:-2], num_tiles, TILE_SIZE, num_tiles, TILE_SIZE)
    diagonal_inverse = _invert_unit_lower(
        jnp.stack([blocks[..., i, :, i, :] for i in range(num_tiles)], axis=-3))
    rhs = _tiles(rhs)
    solved = []
    for i in range(num_tiles):
        residual = rhs[..., i, :, :]
        for m in range(i):
            residual = residual - einsum("...rs,...sn->...rn", blocks[..., i, :, m, :], solved[m])
        solved.append(einsum("...rs,...sn->...rn", diagonal_inverse[..., i, :, :], residual))
    return jnp.concatenate(solved, axis=-2)


def _document_masks(starts, num_chunks, chunk):
    """Document bookkeeping per chunk from the document-start flags.

    Args:
      starts: bool [B, N*C].
    Returns:
      same_document [B, N, C, C], reads_state [B, N, C], writes_state [B, N, C],
      keeps_state [B, N]: whether row i / column j / the chunk as a whole belongs to the document
      that was live when the chunk began (reads, keeps) or to the chunk's last document (writes).
    """
    document = jnp.cumsum(starts, axis=1, dtype=jnp.int32).reshape(-1, num_chunks, chunk)
    # The document live just before each chunk: the previous chunk's last one (chunk 0: the first).
    live_before = jnp.pad(document[:, :-1, -1], ((0, 0), (1, 0)))
    same_document = document[..., :, None] == document[..., None, :]
    reads_state = document == live_before[..., None]
    writes_state = document == document[..., -1:]
    return same_document, reads_state, writes_state, reads_state[..., -1]


class ChunkedInputs(NamedTuple):
    """What the recurrence over chunks consumes, per batch row, value head and chunk.

    Everything here is computed in parallel over chunks (`prepare_chunks`); only the state
    passing between chunks is sequential (`chunk_recurrence`, or a kernel with its contract).
    """

    W: jax.Array  # [B, HV, N, C, K]   (I + Akk)^-1 (beta k exp(G))
    U: jax.Array  # [B, HV, N, C, V]   (I + Akk)^-1 (beta v)
    q_from_state: jax.Array  # [B, HV, N, C, K]   q exp(G): reads the entering state
    k_to_state: jax.Array  # [B, HV, N, C, K]   k exp(G_last - G): writes the leaving state
    chunk_decay: jax.Array  # [B, HV, N, K]   exp(G_last): decays the state across the chunk
    Aqk: jax.Array  # [B, HV, N, C, C]   causal scores, diagonal included


def prepare_chunks(q, k, v, g, beta, *, scale, segment_ids, use_qk_l2norm, gate_lower_bound,
                   chunk_size):
    """The chunk-parallel part of KDA: scores, document masks and the UT transform.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV].
      scale, segment_ids, use_qk_l2norm, gate_lower_bound: as in `chunk_kda`.
      chunk_size: C; T is padded up to N = ceil(T / C) chunks.
    Returns:
      `ChunkedInputs` in the compute dtype (float32, or float64 for float64 inputs).
    """
    batch, length, num_value_heads, _ = v.shape
    q, k = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm,
                      num_value_heads=num_value_heads)
    key_dim, dtype = q.shape[-1], q.dtype
    starts = document_starts(segment_ids)

    # Padded tokens leave the state untouched; their outputs are dropped.
    num_chunks = -(-length // chunk_size)

    def to_chunks(x):
        """[B, T, HV, ...] -> [B, HV, N, C, ...] in the compute dtype."""
        return tokens_to_chunks(pad_tokens(x.astype(dtype), chunk_size), chunk_size)

    q, k, v, g = map(to_chunks, (q, k, v, g))
    beta = to_chunks(beta)[..., None]  # [B, HV, N, C, 1]
    if gate_lower_bound is None:  # any gate down to -inf: erasing gates counted apart
        G, E = erasing_cumsum(g)
        E_start, E_last = 0, E[..., -1:, :]
    else:  # the caller promises g >= L >= -5: nothing erases
        G, E = jnp.cumsum(g, axis=-2), None
        E_start = E_last = None
    Aqk, Akk = intra_chunk_scores(q, k, G, gate_lower_bound, E)
    decay_from_start = jnp.exp(_span(G, 0.0, E, E_start))  # [B, HV, N, C, K]
    decay_to_end = jnp.exp(_span(G[..., -1:, :], G, E_last, E))
    chunk_decay = decay_from_start[..., -1, :]  # [B, HV, N, K]
    if starts is not None:
        starts = pad_tokens(starts, chunk_size)
        same_document, reads_state, writes_state, keeps_state = (
            m[:, None] for m in _document_masks(starts, num_chunks, chunk_size))
        Aqk = jnp.where(same_document, Aqk, 0.0)
        Akk = jnp.where(same_document, Akk, 0.0)
        decay_from_start = jnp.where(reads_state[..., None], decay_from_start, 0.0)
        decay_to_end = jnp.where(writes_state[..., None], decay_to_end, 0.0)
        chunk_decay = jnp.where(keeps_state[..., None], chunk_decay, 0.0)

    # UT transform: one unit-lower-triangular solve gives W and U together.
    rhs = jnp.concatenate([beta * k * decay_from_start, beta * v], axis=-1)
    WU = solve_unit_lower(beta * Akk, rhs)
    return ChunkedInputs(W=WU[..., :key_dim], U=WU[..., key_dim:],
                         q_from_state=q * decay_from_start, k_to_state=k * decay_to_end,
                         chunk_decay=chunk_decay, Aqk=Aqk)


def chunk_recurrence(chunks: ChunkedInputs, initial_state, out_dtype):
    """The sequential part of KDA in plain JAX: `lax.scan` carries the state from chunk to chunk.

    Per chunk, with `S` the entering state:

        V_new = U - W S
        O = q_from_state S + Aqk V_new
        S_next = chunk_decay * S + k_to_state^T V_new

    Args:
      chunks: `ChunkedInputs` [B, HV, N, ...].
      initial_state: [B, HV, K, V] in the compute dtype.
      out_dtype: dtype of the chunk outputs.
    Returns:
      (o [B, HV, N, C, V] in out_dtype, final_state [B, HV, K, V] in the compute dtype).
    """

    def chunk_step(state, xs):
        w, u, q_s, k_s, decay = xs
        v_new = u - einsum("bhck,bhkv->bhcv", w, state)
        o_inter = einsum("bhck,bhkv->bhcv", q_s, state)
        state = decay[..., None] * state + einsum("bhck,bhcv->bhkv", k_s, v_new)
        return state, (v_new, o_inter)

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
    sequential = (chunks.W, chunks.U, chunks.q_from_state, chunks.k_to_state, chunks.chunk_decay)
    final_state, (v_new, o_inter) = lax.scan(chunk_step, initial_state,
                                             tuple(map(chunk_major, sequential)))
    v_new, o_inter = (jnp.moveaxis(x, 0, 2) for x in (v_new, o_inter))
    o = o_inter + einsum("bhnij,bhnjv->bhniv", chunks.Aqk, v_new)
    return o.astype(out_dtype), final_state


def chunk_kda_with_recurrence(
    recurrence,
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    use_qk_l2norm=False,
    gate_lower_bound=None,
    chunk_size=CHUNK_SIZE,
):
    """`chunk_kda` with the sequential part replaced by `recurrence` (e.g. a GPU kernel).

    Args:
      recurrence: `(ChunkedInputs, initial_state, out_dtype) -> (o [B, HV, N, C, V],
        final_state [B, HV, K, V])` with the contract of `chunk_recurrence`.
      The other arguments and the results are those of `chunk_kda`.
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    batch, length, num_value_heads, value_dim = v.shape
    chunks = prepare_chunks(q, k, v, g, beta, scale=scale, segment_ids=segment_ids,
                            use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound,
                            chunk_size=chunk_size)
    key_dim, dtype = chunks.W.shape[-1], chunks.W.dtype
    if initial_state is None:
        initial_state = jnp.zeros((batch, num_value_heads, key_dim, value_dim), dtype)
    o, final_state = recurrence(chunks, initial_state.astype(dtype), v.dtype)
    return chunks_to_tokens(o)[:, :length], (final_state if output_final_state else None)


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    use_qk_l2norm=False,
    gate_lower_bound=None,
    chunk_size=CHUNK_SIZE,
):
    """KDA by chunks; same arguments and results as `kda.reference.kda_reference`.

    Args:
      q, k: [B, T, H, K].
      v: [B, T, HV, V], HV a multiple of H.
      g: [B, T, HV, K] log-decay (<= 0); without `gate_lower_bound` down to -inf (gates
        <= ERASING_GATE erase their channel exactly).
      beta: [B, T, HV].
      scale: read scale.
      initial_state: float32 [B, HV, K, V] or None.
      output_final_state: also return the state after the last token.
      segment_ids: integer [B, T] or None (packed documents).
      use_qk_l2norm: L2-normalise q and k per head.
      gate_lower_bound: None, or L in [-5, 0) when the caller guarantees g >= L; then the diagonal
        16-token tiles are computed as matmuls. Gates below L make the result undefined.
      chunk_size: 16, 32 or 64 tokens; T need not be a multiple (the tail is padded).
    Returns:
      (o [B, T, HV, V] in v.dtype, final_state float32 [B, HV, K, V] or None).

    A NaN (or a gate of +inf) here spreads through the chunk's matmuls to earlier tokens and
    other documents; `kda.kda_attention` confines non-finite inputs around this op.
    """
    return chunk_kda_with_recurrence(
        chunk_recurrence, q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids,
        use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound, chunk_size=chunk_size)
