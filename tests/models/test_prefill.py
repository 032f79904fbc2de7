"""Chunked prefill: every position's logits equal the full forward, one program for any number of
chunks, the LM head on the last position only unless every position's logits are asked for, clear
errors for a bad chunk size or a pool without room.

The model has KDA and MLA layers both (four layers, KDA through its recurrent oracle: the same
maths, a faster compile on CPU; `tests/kda` checks the chunked op == the oracle with a state).
Pages of 4 tokens and chunks of 6 or 4 make chunks start inside pages as well as on their edges.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.jit_split import split_for_jit
from models.lm import DecodeState
from models.paged_cache import PageAllocator
from models.prefill import _extend_chunk, prefill

VOCAB = 264
PAGE = 4
TOKENS = jax.random.randint(jax.random.key(2), (2, 12), 0, VOCAB, jnp.int32)


@pytest.mark.slow
def test_chunked_prefill_equals_the_full_forward(model, full_forward):
    # Chunks of 6 over T = 12: the second starts inside a page (chunks that start on page edges:
    # the one-program test; a shorter last chunk: test_generate's chunks of 4 over 5 tokens).
    full = full_forward(model, TOKENS)
    allocator = PageAllocator.holding(2, TOKENS.shape[1], PAGE)
    before = _extend_chunk._cache_size()
    logits, state = prefill(model, TOKENS, chunk_tokens=6, allocator=allocator, all_logits=True)
    assert _extend_chunk._cache_size() - before <= 1  # both chunks run one program
    # float32 throughout: chunked and one-shot differ only by the order of float32 sums.
    np.testing.assert_allclose(logits, full, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(state.lengths, [12, 12])
    assert allocator.num_free == 0  # every page of the pool holds the prompt's latents


def test_one_program_for_any_number_of_chunks(model, full_forward):
    # One allocator shape for both prompts: the state's shapes do not depend on the prompt.
    def run(length):
        last, _ = prefill(model, TOKENS[:, :length], chunk_tokens=4,
                          allocator=PageAllocator.holding(2, TOKENS.shape[1], PAGE))
        return last, _extend_chunk._cache_size()

    before = _extend_chunk._cache_size()
    _, after_one_chunk = run(4)
    assert after_one_chunk - before <= 1  # (0 if an earlier test compiled the same shapes)
    last, programs = run(12)
    assert programs == after_one_chunk  # three chunks, starting on page edges: no new program
    # Without all_logits, the last position's logits, equal to the full forward's.
    np.testing.assert_allclose(last, full_forward(model, TOKENS)[:, -1], rtol=2e-5, atol=2e-5)


def array_shapes(jaxpr) -> set[tuple[int, ...]]:
    """The shapes of every value `jaxpr` computes, in the jaxprs it calls too (jit, loops)."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    shapes |= array_shapes(inner)
    return shapes


@pytest.mark.parametrize("all_logits", [False, True])
def test_lm_head_runs_on_the_last_position_only_unless_all_logits(model, all_logits):
    allocator = PageAllocator.holding(2, TOKENS.shape[1], PAGE)
    allocator.reserve(0, 5)
    allocator.reserve(1, 5)
    state = model.init_decode_state(2, num_pages=allocator.num_pages, page_size=PAGE,
                                    max_pages_per_seq=allocator.max_pages_per_seq)
    state = DecodeState(state.caches, jnp.asarray(allocator.block_tables), state.lengths)
    structure, variables = split_for_jit(model)
    jaxpr = jax.make_jaxpr(_extend_chunk, static_argnums=(0, 1))(
        structure, all_logits, variables, TOKENS[:, :5], state)
    # [B, C, V] logits of the 5-token chunk exist only when they are returned.
    assert ((2, 5, VOCAB) in array_shapes(jaxpr.jaxpr)) == all_logits
    assert jaxpr.out_avals[0].shape == ((2, 5, VOCAB) if all_logits else (2, VOCAB))


def test_bad_chunk_size_or_too_few_pages_raise(model):
    enough = PageAllocator.holding(2, 12, PAGE)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
            prefill(model, TOKENS, chunk_tokens=bad, allocator=enough)
    with pytest.raises(ValueError, match="larger num_pages"):
        prefill(model, TOKENS, chunk_tokens=4, allocator=PageAllocator(6, PAGE, 2, 3))
    with pytest.raises(ValueError, match="larger max_pages_per_seq"):
        prefill(model, TOKENS, chunk_tokens=4, allocator=PageAllocator(20, PAGE, 2, 2))
    with pytest.raises(ValueError, match="num_sequences"):
        prefill(model, TOKENS, chunk_tokens=4, allocator=PageAllocator.holding(3, 12, PAGE))
    with pytest.raises(ValueError, match="prompts"):
        prefill(model, TOKENS[0], chunk_tokens=4, allocator=enough)
    assert enough.num_free == enough.num_pages - 1  # nothing was reserved by a refused call
