"""Softmax attention within documents in memory linear in T: FlashAttention's algorithm in plain
JAX, so that it runs on any backend.

For a block of queries i and a block of keys j (tiles of `block` tokens), with scale c:

    s_ij  = c q_i k_j^T, set to -inf where the documents differ (and, causal, where key > query)
    m_i   = max_j rowmax(s_ij),   l_i = sum_j rowsum(exp(s_ij - m_i))
    o_i   = sum_j exp(s_ij - m_i) v_j / l_i,   lse_i = m_i + log l_i

and the backward pass, given dO, with p_ij = exp(s_ij - lse_i) and D_i = rowsum(dO_i * o_i):

    dv_j = sum_i p_ij^T dO_i,   ds_ij = p_ij * (dO_i v_j^T - D_i),
    dq_i = c sum_j ds_ij k_j,   dk_j = c sum_i ds_ij^T q_i.

What the backward keeps is q, k, v, o and lse [B, H, T]: O(T). The [T, T] scores exist one
[block, block] tile at a time, in float32; the tiles' products with v, dO, k and q take the inputs'
dtype and accumulate in float32. Causal attention skips the tiles above the diagonal.

This is the path a long row takes where no attention kernel can (`models.attention`'s fallback
for rows of more documents than cuDNN's packed layout was sized for): a dense [B, 1, T, T] mask at
T = 128K is 16 GiB a layer before cuDNN turns it into a bias. It is exact, not fast.
"""

import functools

import jax
import jax.numpy as jnp

# Tokens per tile: a [B, H, 512, 512] float32 tile is 1 MiB per row and head.
BLOCK_TOKENS = 512


def _tiles(x: jax.Array, block: int) -> jax.Array:
    """[B, T, ...] -> [T / block, B, block, ...]."""
    return jnp.moveaxis(x.reshape(x.shape[0], -1, block, *x.shape[2:]), 1, 0)


def _untile(x: jax.Array) -> jax.Array:
    """[N, B, block, ...] -> [B, N * block, ...], the inverse of `_tiles`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _tile_scores(q, k, doc_q, doc_k, i, j, *, scale, causal, block):
    """Scores [B, H, Bq, Bk] float32 of query tile i (q [B, Bq, H, D], doc_q [B, Bq]) against key
    tile j, -inf where the key is not visible."""
    scores = scale * jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    visible = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]
    if causal:
        rows = i * block + jnp.arange(block)
        cols = j * block + jnp.arange(block)
        visible &= cols[None, :] <= rows[:, None]
    return jnp.where(visible, scores, -jnp.inf)


def _key_tiles(i, num_tiles, causal):
    """The key tiles query tile i sees: [0, i] when causal, all otherwise."""
    return (0, i + 1) if causal else (0, num_tiles)


def _forward(q, k, v, doc, *, scale, causal, block):
    """o [B, T, H, D] (q's dtype) and lse [N, B, H, block] float32 of tiled inputs."""
    qt, kt, vt, dt = (_tiles(x, block) for x in (q, k, v, doc))
    num_tiles, batch, _, heads, width = qt.shape

    def query_tile(args):
        i, q_i, doc_i = args

        def add_key_tile(j, carry):
            m, l, acc = carry
            s = _tile_scores(q_i, kt[j], doc_i, dt[j], i, j, scale=scale, causal=causal,
                             block=block)
            m_new = jnp.maximum(m, s.max(-1))
            # A query that has seen no visible key yet keeps 0 as its reference: no -inf - -inf.
            ref = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - ref[..., None])  # 0 where not visible
            rescale = jnp.exp(m - ref)
            acc = rescale[..., None] * acc + jnp.einsum(
                "bhqk,bkhd->bhqd", p.astype(v.dtype), vt[j], preferred_element_type=jnp.float32)
            return m_new, rescale * l + p.sum(-1), acc

        start = (jnp.full((batch, heads, block), -jnp.inf, jnp.float32),
                 jnp.zeros((batch, heads, block), jnp.float32),
                 jnp.zeros((batch, heads, block, width), jnp.float32))
        m, l, acc = jax.lax.fori_loop(*_key_tiles(i, num_tiles, causal), add_key_tile, start)
        out = jnp.swapaxes(acc / l[..., None], 1, 2).astype(q.dtype)  # [B, Bq, H, D]
        return out, m + jnp.log(l)

    out, lse = jax.lax.map(query_tile, (jnp.arange(num_tiles), qt, dt))
    return _untile(out), lse


def _backward(q, k, v, doc, out, lse, d_out, *, scale, causal, block):
    """(dq, dk, dv) of tiled inputs, each in its input's dtype."""
    qt, kt, vt, dt, dot = (_tiles(x, block) for x in (q, k, v, doc, d_out))
    num_tiles = qt.shape[0]
    # D_i = rowsum(dO_i * o_i): [N, B, H, block].
    delta = jnp.einsum("nbqhd,nbqhd->nbhq", dot.astype(jnp.float32),
                       _tiles(out, block).astype(jnp.float32))

    def probabilities(i, j):
        s = _tile_scores(qt[i], kt[j], dt[i], dt[j], i, j, scale=scale, causal=causal,
                         block=block)
        return jnp.exp(s - lse[i][..., None])  # [B, H, Bq, Bk]; 0 where not visible

    def score_grads(i, j, p):
        dp = jnp.einsum("bqhd,bkhd->bhqk", dot[i], vt[j], preferred_element_type=jnp.float32)
        return p * (dp - delta[i][..., None])

    def query_tile(i):
        def add_key_tile(j, dq):
            ds = score_grads(i, j, probabilities(i, j))
            return dq + scale * jnp.einsum("bhqk,bkhd->bqhd", ds.astype(k.dtype), kt[j],
                                           preferred_element_type=jnp.float32)

        dq = jnp.zeros(qt.shape[1:], jnp.float32)
        return jax.lax.fori_loop(*_key_tiles(i, num_tiles, causal), add_key_tile, dq)

    def key_tile(j):
        def add_query_tile(i, grads):
            dk, dv = grads
            p = probabilities(i, j)
            ds = score_grads(i, j, p)
            dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p.astype(d_out.dtype), dot[i],
                                 preferred_element_type=jnp.float32)
            dk = dk + scale * jnp.einsum("bhqk,bqhd->bkhd", ds.astype(q.dtype), qt[i],
                                         preferred_element_type=jnp.float32)
            return dk, dv

        zeros = jnp.zeros(kt.shape[1:], jnp.float32)
        first = j if causal else 0  # causal: only queries at or after the key tile see it
        return jax.lax.fori_loop(first, num_tiles, add_query_tile, (zeros, zeros))

    dq = jax.lax.map(query_tile, jnp.arange(num_tiles))
    dk, dv = jax.lax.map(key_tile, jnp.arange(num_tiles))
    return tuple(_untile(g).astype(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled_attention(q, k, v, doc, scale, causal, block):
    return _forward(q, k, v, doc, scale=scale, causal=causal, block=block)[0]


def _tiled_attention_fwd(q, k, v, doc, scale, causal, block):
    out, lse = _forward(q, k, v, doc, scale=scale, causal=causal, block=block)
    return out, (q, k, v, doc, out, lse)


def _tiled_attention_bwd(scale, causal, block, residuals, d_out):
    q, k, v, doc, out, lse = residuals
    grads = _backward(q, k, v, doc, out, lse, d_out, scale=scale, causal=causal, block=block)
    return (*grads, None)


_tiled_attention.defvjp(_tiled_attention_fwd, _tiled_attention_bwd)


def blockwise_document_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, document_ids: jax.Array | None,
    causal: bool, block: int = BLOCK_TOKENS,
) -> jax.Array:
    """Attention of each query to the keys of its own document (and, causal, not after it).

    q, k, v: [B, T, H, D], one head size; document_ids: [B, T] int, the document of each token
    (`kda.common.document_index`; None: one document a row) -> [B, T, H, D] in q's dtype.
    block: tokens per tile; T is padded up to a multiple of it (the padding is its own document).
    Differentiable in q, k and v (a custom VJP that recomputes the tiles from lse).
    """
    batch, length = q.shape[:2]
    block = min(block, length)
    if document_ids is None:
        document_ids = jnp.zeros((batch, length), jnp.int32)
    padding = -length % block
    if padding:
        pad = lambda x, value=0: jnp.pad(  # noqa: E731
            x, [(0, 0), (0, padding)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
        q, k, v = pad(q), pad(k), pad(v)
        # Below every real id, so the padding forms a document no real token sees.
        document_ids = pad(document_ids, jnp.iinfo(jnp.int32).min)
    out = _tiled_attention(q, k, v, document_ids.astype(jnp.int32), scale, causal, block)
    return out[:, :length]
