"""Generation: greedy decode == argmax of the full forward, the same after a chunked prefill,
sampling filters, seeds, stopping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.generate import Sampling, filter_logits, generate, sample_tokens

VOCAB = 264
PROMPTS = jax.random.randint(jax.random.key(1), (2, 5), 0, VOCAB, jnp.int32)
# Every test's pages and state shapes alike: one prefill program serves them all. Prompt + new
# tokens make 12, test_prefill's length: the full forward's program is compiled once a suite.
PAGE, NEW = 4, 7


@pytest.mark.slow
def test_greedy_decode_is_argmax_of_full_forward_at_every_step(model, full_forward):
    result = generate(model, PROMPTS, max_new_tokens=NEW, page_size=PAGE)
    assert result.tokens.shape == (2, NEW) and list(result.lengths) == [NEW, NEW]
    sequence = jnp.concatenate([PROMPTS, jnp.asarray(result.tokens)], axis=1)
    argmax = np.asarray(jnp.argmax(full_forward(model, sequence), axis=-1))
    # Token i was generated after prompt + tokens[:i]: the logits at position T - 1 + i.
    np.testing.assert_array_equal(result.tokens, argmax[:, PROMPTS.shape[1] - 1 : -1])


@pytest.mark.slow
def test_decode_after_chunked_prefill_equals_decode_after_one_shot_prefill(model):
    # The greedy test's prompts and lengths: the one-shot run and the decode reuse its programs.
    one_shot = generate(model, PROMPTS, max_new_tokens=NEW, page_size=PAGE)
    # Five full chunks of one, starting inside pages and on their edges; one of four and a tail
    # of one (the one-token chunk program again).
    for chunk in (1, 4):
        chunked = generate(model, PROMPTS, max_new_tokens=NEW, page_size=PAGE,
                           prefill_chunk_tokens=chunk)
        np.testing.assert_array_equal(chunked.tokens, one_shot.tokens)


@pytest.mark.slow
def test_sampling_is_seeded_and_stops_at_the_end_token(model):
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9)
    first = generate(model, PROMPTS, max_new_tokens=NEW, page_size=PAGE, sampling=sampling,
                     seed=3)
    again = generate(model, PROMPTS, max_new_tokens=NEW, page_size=PAGE, sampling=sampling,
                     seed=3)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    other = generate(model, PROMPTS, max_new_tokens=NEW, page_size=PAGE, sampling=sampling,
                     seed=4)
    assert not np.array_equal(first.tokens, other.tokens)
    # Make the second token of row 0 the end token: row 0 stops there, row 1 runs on.
    end = int(first.tokens[0, 1])
    stopped = generate(model, PROMPTS, max_new_tokens=NEW, page_size=PAGE, sampling=sampling,
                       seed=3, end_token=end, pad_token=-1)
    stop_row0 = list(first.tokens[0]).index(end) + 1
    assert stopped.lengths[0] == stop_row0
    np.testing.assert_array_equal(stopped.tokens[0, :stop_row0], first.tokens[0, :stop_row0])
    assert (stopped.tokens[0, stop_row0:] == -1).all()
    row1_stop = list(first.tokens[1]).index(end) + 1 if end in first.tokens[1] else NEW
    assert stopped.lengths[1] == row1_stop
    np.testing.assert_array_equal(stopped.tokens[1, :row1_stop], first.tokens[1, :row1_stop])


def test_filter_logits_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    top2 = filter_logits(logits, top_k=2, top_p=None)
    assert np.isfinite(top2[0, :2]).all() and np.isneginf(top2[0, 2:]).all()
    # Nucleus of 0.8: 0.5 + 0.2 < 0.8, so the third token (0.15) is needed too.
    nucleus = filter_logits(logits, top_k=None, top_p=0.8)
    assert np.isfinite(nucleus[0, :3]).all() and np.isneginf(nucleus[0, 3:]).all()
    # Below the first token's probability only the argmax survives.
    assert np.isfinite(filter_logits(logits, None, 0.3)[0]).sum() == 1
    np.testing.assert_array_equal(filter_logits(logits, None, 1.0), logits)


def test_sampled_frequencies_follow_the_filtered_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]] * 4000))
    tokens = sample_tokens(logits, jax.random.key(0), Sampling(temperature=1.0, top_k=2))
    freq = np.bincount(np.asarray(tokens), minlength=3) / tokens.size
    np.testing.assert_allclose(freq, [0.625, 0.375, 0.0], atol=0.03)
    greedy = sample_tokens(logits[:2], jax.random.key(0), Sampling())
    np.testing.assert_array_equal(greedy, [0, 0])


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p")],
)
def test_bad_sampling_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


def test_bad_generate_arguments_raise(model):
    with pytest.raises(ValueError, match="prompts"):
        generate(model, jnp.zeros((3,), jnp.int32), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, PROMPTS, max_new_tokens=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        generate(model, PROMPTS, max_new_tokens=2, prefill_chunk_tokens=0)
