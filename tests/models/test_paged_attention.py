"""Paged attention over the block table (`models.attention.paged_latent_attention`).

It equals the dense `absorbed_latent_attention` over the gathered cache for ragged rows, for every
block size (one page, sizes that do not divide the table, wider than the longest row or than the
table), for decode (T = 1) and chunk (T > 1) queries, for rows whose tables point at the null page
past their length and rows that ran past their table; it never reads the blocks past the batch's
longest row; the layer's cached path over several blocks equals its full forward; its compiled
temporaries do not grow with the cache's capacity (the dense path's do); and a perturbed online
softmax, mask or block count fails the comparison.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention
from models.attention import (
    GatedMLA,
    MLAConfig,
    OnlineSoftmax,
    absorbed_latent_attention,
    blocks_to_read,
    paged_latent_attention,
)
from models.paged_cache import NULL_PAGE, PageAllocator, PagedLatentCache, init_pages

HEADS, NOPE, ROPE, RANK, VALUE = 2, 4, 3, 5, 6
PAGE = 4
MAX_PAGES = 7  # a capacity of 28 tokens
SCALE = (NOPE + ROPE) ** -0.5
# The rows own 1, 4 and 6 of their 7 pages; row 0 is a fresh sequence (its first chunk of 3).
LENGTHS = (3, 13, 22)
# One page; 3 and 4 do not divide the table's 7 pages; 7 (the whole table) is wider than the
# longest row's 6 pages; 20 is wider than the table.
BLOCK_SIZES = (1, 3, 4, 7, 20)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # float32: the two differ only by the order of sums


def ragged_cache(lengths, seed: int, max_pages: int = MAX_PAGES) -> PagedLatentCache:
    """A pool where row b owns ceil(lengths[b] / PAGE) pages (at most the table's width), taken
    from the pool in a random order, the rest of its table the null page. Every page, the null page
    and a few that nobody owns included, holds random latents, so a wrongly read token shows."""
    batch = len(lengths)
    num_pages = 1 + batch * max_pages + 3
    rng = np.random.default_rng(seed)
    pages = rng.normal(size=(num_pages, PAGE, RANK + ROPE)).astype(np.float32)
    order = rng.permutation(np.arange(1, num_pages))
    tables = np.full((batch, max_pages), NULL_PAGE, np.int32)
    taken = 0
    for row, length in enumerate(lengths):
        owned = min(-(-length // PAGE), max_pages)
        tables[row, :owned] = order[taken : taken + owned]
        taken += owned
    return PagedLatentCache(jnp.asarray(pages), jnp.asarray(tables),
                            jnp.asarray(lengths, jnp.int32))


def gathered(cache: PagedLatentCache) -> jax.Array:
    """Every row's latents in logical order, [B, capacity, C + R]: what the dense path reads."""
    batch, max_pages = cache.block_tables.shape
    return cache.pages[cache.block_tables].reshape(batch, max_pages * PAGE, -1)


def queries(batch: int, length: int, seed: int):
    """q_nope [B, T, H, N], q_rope [B, T, H, R] and kv_up [C, H, N + V], random."""
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (batch, length, HEADS, NOPE)),
            jax.random.normal(keys[1], (batch, length, HEADS, ROPE)),
            jax.random.normal(keys[2], (RANK, HEADS, NOPE + VALUE)))


def last_positions(cache: PagedLatentCache, length: int) -> jax.Array:
    """The positions [B, T] of the last T tokens of each row: the queries just appended."""
    return cache.lengths[:, None] - length + jnp.arange(length, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames="pages_per_block")
def paged(q_nope, q_rope, cache, kv_up, positions, pages_per_block):
    return paged_latent_attention(q_nope, q_rope, cache, kv_up, positions, scale=SCALE,
                                  pages_per_block=pages_per_block)


@jax.jit
def dense(q_nope, q_rope, cache, kv_up, positions):
    return absorbed_latent_attention(q_nope, q_rope, gathered(cache), kv_up, positions,
                                     scale=SCALE)


def paged_and_dense(cache, length, pages_per_block, seed=0, call=paged):
    q_nope, q_rope, kv_up = queries(cache.lengths.shape[0], length, seed)
    positions = last_positions(cache, length)
    return (call(q_nope, q_rope, cache, kv_up, positions, pages_per_block=pages_per_block),
            dense(q_nope, q_rope, cache, kv_up, positions))


@pytest.mark.parametrize("length", [1, 3])  # a decode step; a prefill chunk
@pytest.mark.parametrize("pages_per_block", BLOCK_SIZES)
def test_paged_equals_dense_over_the_gathered_cache(length, pages_per_block):
    cache = ragged_cache(LENGTHS, seed=length)
    assert (np.asarray(cache.block_tables) == NULL_PAGE).sum() == 3 * MAX_PAGES - 11  # ragged rows
    got, want = paged_and_dense(cache, length, pages_per_block)
    assert got.shape == (len(LENGTHS), length, HEADS, VALUE)
    np.testing.assert_allclose(got, want, **TOLERANCE)


@pytest.mark.parametrize("pages_per_block", [2, 20])
def test_rows_that_ran_past_their_table(pages_per_block):
    # Row 0 ended and released its pages (its table is all null page) and keeps decoding past the
    # capacity; row 1 fills its table exactly. Both see every position their table holds.
    cache = ragged_cache((30, 28, 9), seed=3)
    cache = dataclasses.replace(cache, block_tables=cache.block_tables.at[0].set(NULL_PAGE))
    got, want = paged_and_dense(cache, 1, pages_per_block)
    np.testing.assert_allclose(got, want, **TOLERANCE)


def test_blocks_past_the_longest_row_are_never_read():
    # Blocks of 2 pages: the longest row (13 tokens, 4 pages) needs blocks 0 and 1. Every table
    # entry from page 4 on points at a page of NaN: one read of it would make the output NaN (a
    # masked score weighs 0, and 0 * NaN is NaN). Row 0's pages 1..3 lie in the blocks read: they
    # stay on the (finite) null page, masked.
    cache = ragged_cache((3, 13, 9), seed=4)
    nan_page = min(set(range(1, cache.pages.shape[0])) - set(np.asarray(cache.block_tables).flat))
    tables = cache.block_tables.at[:, 4:].set(nan_page)
    cache = dataclasses.replace(cache, pages=cache.pages.at[nan_page].set(jnp.nan),
                                block_tables=tables)
    positions = last_positions(cache, 1)
    assert int(blocks_to_read(positions, cache.lengths, 2 * PAGE)) == 2
    q_nope, q_rope, kv_up = queries(3, 1, seed=5)
    got = paged(q_nope, q_rope, cache, kv_up, positions, pages_per_block=2)
    clean = dataclasses.replace(cache, block_tables=cache.block_tables.at[:, 4:].set(NULL_PAGE))
    np.testing.assert_allclose(got, dense(q_nope, q_rope, clean, kv_up, positions), **TOLERANCE)


def test_blocks_to_read_counts_the_blocks_some_query_sees():
    positions = jnp.array([[4, 5], [10, 11]], jnp.int32)
    # Rows see keys < 6 and < 12: 12 keys, two blocks of 8, whatever the table's width.
    assert int(blocks_to_read(positions, jnp.array([6, 12]), 8)) == 2
    assert int(blocks_to_read(positions, jnp.array([6, 12]), 4)) == 3  # exact: 12 / 4
    # Fewer tokens held than the positions (a row past its table's end) bound what is seen.
    assert int(blocks_to_read(positions, jnp.array([6, 3]), 4)) == 2


D_MODEL = 16
LAYER_CFG = MLAConfig(num_heads=HEADS, q_lora_rank=8, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                      qk_rope_head_dim=ROPE, v_head_dim=VALUE)


@jax.jit
def layer_forward(layer, x):
    return layer(x)


@jax.jit
def layer_cached(layer, x, cache):
    return layer(x, cache=cache)


@pytest.mark.parametrize("pages_per_block", [1, 4])
def test_layer_cached_path_over_several_blocks_equals_its_full_forward(pages_per_block):
    # Pages of 2 tokens, 11 tokens: a prefill chunk of 4 then one token at a time, over 1 to 6
    # pages, so the later steps take several blocks (the last one partly past the table).
    cfg = dataclasses.replace(LAYER_CFG, cache_pages_per_block=pages_per_block)
    layer = GatedMLA(D_MODEL, cfg, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(8), (2, 11, D_MODEL))
    page_size, max_pages = 2, 6
    allocator = PageAllocator(1 + 2 * max_pages, page_size, 2, max_pages)
    cache = PagedLatentCache(init_pages(allocator.num_pages, page_size, cfg.latent_dim,
                                        jnp.float32),
                             jnp.asarray(allocator.block_tables), jnp.zeros((2,), jnp.int32))
    outputs, start = [], 0
    for size in [4] + [1] * 7:
        for row in (1, 0):  # interleaved pages, in another order than the rows
            allocator.reserve(row, start + size)
        cache = dataclasses.replace(cache, block_tables=jnp.asarray(allocator.block_tables))
        y, cache = layer_cached(layer, x[:, start : start + size], cache)
        outputs.append(y)
        start += size
    np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), layer_forward(layer, x),
                               **TOLERANCE)


def temp_bytes(fn, max_pages: int, batch: int = 2, length: int = 8, page: int = 16) -> int:
    """XLA's temporaries of `fn(q_nope, q_rope, cache, kv_up, positions)` compiled for a cache of
    `max_pages` pages of `page` tokens per row (a pool that holds them all)."""
    rank = 32
    spec = jax.ShapeDtypeStruct
    cache = PagedLatentCache(spec((1 + batch * max_pages, page, rank + ROPE), jnp.float32),
                             spec((batch, max_pages), jnp.int32), spec((batch,), jnp.int32))
    args = (spec((batch, length, HEADS, NOPE), jnp.float32),
            spec((batch, length, HEADS, ROPE), jnp.float32), cache,
            spec((rank, HEADS, NOPE + VALUE), jnp.float32), spec((batch, length), jnp.int32))
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_compiled_temporaries_do_not_grow_with_capacity():
    def blocked(q_nope, q_rope, cache, kv_up, positions):
        return paged_latent_attention(q_nope, q_rope, cache, kv_up, positions, scale=SCALE,
                                      pages_per_block=4)

    def over_gathered(q_nope, q_rope, cache, kv_up, positions):
        batch, max_pages = cache.block_tables.shape
        latents = cache.pages[cache.block_tables].reshape(batch, max_pages * 16, -1)
        return absorbed_latent_attention(q_nope, q_rope, latents, kv_up, positions, scale=SCALE)

    # 256 and 4096 tokens per row: 16 times the capacity.
    small, large = (temp_bytes(blocked, pages) for pages in (16, 256))
    dense_small, dense_large = (temp_bytes(over_gathered, pages) for pages in (16, 256))
    assert dense_large > 8 * dense_small  # the gather and the [B, H, T, capacity] scores
    assert large <= small + 1024  # one block's gather and scores, whatever the capacity
    assert large < dense_small  # already below the dense path at the smaller capacity


def no_rescale(state, scores, c_kv, dtype):
    """`online_softmax_update` that forgets to rescale the old terms by exp(m_old - m_new)."""
    new_max = jnp.maximum(state.max_score, jnp.max(scores, axis=-1))
    reference = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
    weights = jnp.exp(scores - reference[..., None])
    block_acc = jnp.einsum("bhtk,bkc->bthc", weights, c_kv)
    return OnlineSoftmax(new_max, state.total + jnp.sum(weights, axis=-1), state.acc + block_acc)


def strictly_before(key_positions, query_positions, held):
    """`visible_keys` with key < query: a query that misses its own key."""
    return ((key_positions[None, None, None, :] < query_positions[:, None, :, None])
            & (key_positions[None, None, None, :] < held[:, None, None, None]))


def one_block_short(query_positions, held, block_tokens):
    """`blocks_to_read` that rounds down: the last, partial block is never read."""
    seen = jnp.minimum(held, jnp.max(query_positions, axis=1) + 1)
    return (jnp.max(seen) // block_tokens).astype(jnp.int32)


@pytest.mark.parametrize("name, perturbed", [
    ("online_softmax_update", no_rescale),
    ("visible_keys", strictly_before),
    ("blocks_to_read", one_block_short),
])
def test_a_perturbed_implementation_fails_the_comparison(monkeypatch, name, perturbed):
    cache = ragged_cache(LENGTHS, seed=6)
    intact, want = paged_and_dense(cache, 3, 1, call=paged_latent_attention_eager)
    np.testing.assert_allclose(intact, want, **TOLERANCE)
    monkeypatch.setattr(attention, name, perturbed)
    got, _ = paged_and_dense(cache, 3, 1, call=paged_latent_attention_eager)  # traced afresh
    assert not np.allclose(got, want, **TOLERANCE)


def paged_latent_attention_eager(q_nope, q_rope, cache, kv_up, positions, pages_per_block):
    """Unjitted, so that a monkeypatched helper is traced in rather than a cached program run."""
    return paged_latent_attention(q_nope, q_rope, cache, kv_up, positions, scale=SCALE,
                                  pages_per_block=pages_per_block)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, None])
def test_bad_block_size_names_the_argument(bad):
    cache = ragged_cache(LENGTHS, seed=0)
    q_nope, q_rope, kv_up = queries(3, 1, seed=0)
    with pytest.raises(ValueError, match="pages_per_block must be a positive int"):
        paged_latent_attention(q_nope, q_rope, cache, kv_up, last_positions(cache, 1),
                               scale=SCALE, pages_per_block=bad)
    with pytest.raises(ValueError, match="MLAConfig.cache_pages_per_block"):
        dataclasses.replace(LAYER_CFG, cache_pages_per_block=bad)
