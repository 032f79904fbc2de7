"""The serving engine: greedy == argmax of the full forward, a mixed batch gives each request its
tokens alone, log-probabilities of the distribution sampled from, a pool smaller than the worst
case completes everything by waiting and preempting (same tokens), prefix sharing (same tokens,
fewer pages), a fixed handful of compiled programs, clear refusals.

Every engine here has one shape (3 slots, a pool of 12 pages of 4 tokens, sequences of 24 tokens,
prefill chunks of 1, 2 and 4 tokens), so the module compiles the serving programs once.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.generate import Sampling, filter_logits
from models.paged_cache import NULL_PAGE, PageAllocator
from models.serving import (
    Engine,
    Request,
    RowSampling,
    chunk_buckets,
    compiled_programs,
    next_chunk,
    sample_rows,
)

VOCAB = 264
PAGE, SLOTS, POOL, MAX_LEN, CHUNK = 4, 3, 13, 24, 4
RNG = np.random.default_rng(0)


def prompt(length: int) -> tuple[int, ...]:
    return tuple(int(t) for t in RNG.integers(0, VOCAB, length))


# Prompt lengths 1 (straight to decode), 13 (chunks 4, 4, 4), 6 (4, 1), 9 (4, 4), 4 (2, 1).
REQUESTS = [
    Request(prompt(1), max_tokens=6),
    Request(prompt(13), Sampling(temperature=0.8), seed=1, max_tokens=8),
    Request(prompt(6), Sampling(temperature=1.0, top_k=5), seed=2, max_tokens=7),
    Request(prompt(9), Sampling(temperature=1.2, top_p=0.9), seed=3, max_tokens=9),
    Request(prompt(4), max_tokens=9),
]
# Four requests of up to 23 tokens (6 pages each, 24 for all) for a pool of 12 pages.
LONG = [Request(prompt(10), Sampling(temperature=0.0 if i % 2 else 1.0), seed=i, max_tokens=13)
        for i in range(4)]


def make_engine(model, **options) -> Engine:
    return Engine(model, slots=SLOTS, num_pages=POOL, page_size=PAGE, max_seq_len=MAX_LEN,
                  prefill_chunk_tokens=CHUNK, **options)


@pytest.fixture(scope="module")
def programs(model):
    """(compiled serving programs before, after) a warmup that compiles all of them."""
    jax.clear_caches()  # count this engine's programs alone, whatever ran before in the process
    before = compiled_programs()
    make_engine(model, prefix_sharing=True).warmup()
    return before, compiled_programs()


@pytest.fixture(scope="module")
def alone(model, programs):
    """Each request of REQUESTS and LONG run by itself, one after another on one engine."""
    engine = make_engine(model)
    return [engine.run([request])[0] for request in REQUESTS + LONG]


@pytest.fixture(scope="module")
def batched(model, programs):
    """(engine, completions) of REQUESTS submitted together."""
    engine = make_engine(model)
    return engine, engine.run(REQUESTS)


@pytest.fixture(scope="module")
def full_logits(model, full_forward, alone):
    """The full forward's logits [N, MAX_LEN, V] of each of REQUESTS' prompt + completion
    (zero-padded: a causal model's logits do not see the padding after them)."""
    rows = np.zeros((len(REQUESTS), MAX_LEN), np.int32)
    for row, done in enumerate(alone[: len(REQUESTS)]):
        rows[row, : len(done.prompt) + len(done.tokens)] = done.prompt + done.tokens
    return np.asarray(full_forward(model, jnp.asarray(rows)))


def test_greedy_is_the_argmax_of_the_full_forward(alone, batched, full_logits):
    for row, request in enumerate(REQUESTS):
        if request.sampling.temperature:
            continue
        for done in (alone[row], batched[1][row]):
            # Token i follows prompt + tokens[:i]: the logits at position len(prompt) - 1 + i.
            positions = len(done.prompt) - 1 + np.arange(len(done.tokens))
            np.testing.assert_array_equal(done.tokens, full_logits[row, positions].argmax(-1))
            assert done.finish_reason == "length" and len(done.tokens) == request.max_tokens


def test_a_mixed_batch_gives_each_request_its_tokens_alone(alone, batched):
    engine, completions = batched
    for done, single in zip(completions, alone):
        assert done.tokens == single.tokens and done.finish_reason == single.finish_reason
        np.testing.assert_allclose(done.logprobs, single.logprobs, rtol=0, atol=1e-6)
    # The requests ran together: prefill chunks shared steps with decode steps.
    stats = engine.stats
    assert stats.steps < stats.prefill_chunks + stats.decode_steps
    assert stats.decode_steps < sum(len(done.tokens) for done in completions)
    assert engine.pages_in_use == 0 and not engine.has_work


def test_logprobs_are_of_the_distribution_sampled_from(alone, full_logits):
    # Every position of every request in one call: temperature, top_k and top_p per row.
    temperature = np.repeat([r.sampling.temperature or 1.0 for r in REQUESTS], MAX_LEN)
    top_k = np.repeat([r.sampling.top_k or VOCAB for r in REQUESTS], MAX_LEN).astype(np.int32)
    top_p = np.repeat([r.sampling.top_p or 1.0 for r in REQUESTS], MAX_LEN).astype(np.float32)
    logits = full_logits.reshape(-1, VOCAB) / temperature[:, None].astype(np.float32)
    log_probs = np.asarray(jax.jit(lambda x, k, p: jax.nn.log_softmax(filter_logits(x, k, p)))(
        logits, top_k, top_p)).reshape(full_logits.shape)
    for row, request in enumerate(REQUESTS):
        done = alone[row]
        positions = len(done.prompt) - 1 + np.arange(len(done.tokens))
        expected = log_probs[row, positions, list(done.tokens)]
        assert np.isfinite(expected).all()  # every drawn token lies in the filtered set
        # The cached and the full forward's logits differ by float32 rounding (test_prefill).
        np.testing.assert_allclose(done.logprobs, expected, rtol=0, atol=1e-4)


def test_the_seed_sets_the_draw_and_a_stop_token_ends_the_request(model, alone):
    engine = make_engine(model)
    sampled = REQUESTS[1]
    reseeded = engine.run([Request(sampled.prompt, sampled.sampling, seed=9,
                                   max_tokens=sampled.max_tokens)])[0]
    assert reseeded.tokens != alone[1].tokens
    stop = alone[1].tokens[2]
    end = alone[1].tokens.index(stop) + 1
    stopped = engine.run([Request(sampled.prompt, sampled.sampling, seed=sampled.seed,
                                  max_tokens=sampled.max_tokens, stop_tokens=(stop,))])[0]
    assert stopped.finish_reason == "stop" and stopped.tokens == alone[1].tokens[:end]


def test_a_pool_smaller_than_the_worst_case_waits_preempts_and_recomputes(model, alone):
    engine = make_engine(model)
    worst = len(LONG) * math.ceil((len(LONG[0].prompt) + LONG[0].max_tokens - 1) / PAGE)
    assert worst > POOL - 1
    ids = [engine.submit(request) for request in LONG]
    streamed = {i: [] for i in ids}
    for event in engine.stream():
        streamed[event.request_id].append(event.token)
    completions = [engine.completion(i) for i in ids]
    assert engine.stats.preemptions >= 1
    assert sum(done.preemptions for done in completions) == engine.stats.preemptions
    for done, single in zip(completions, alone[len(REQUESTS):]):
        assert done.tokens == single.tokens and len(done.tokens) == LONG[0].max_tokens
        # Each token is streamed once: a resumed request recomputes, it does not re-emit.
        assert tuple(streamed[done.request_id]) == done.tokens
        np.testing.assert_allclose(done.logprobs, single.logprobs, rtol=0, atol=1e-5)
    assert engine.stats.peak_pages <= POOL - 1
    assert engine.stats.pages_allocated > POOL - 1  # freed pages were handed out again
    assert engine.pages_in_use == 0  # every page went back to the free list


def test_prefix_sharing_gives_the_same_tokens_with_fewer_pages(model, programs):
    common = prompt(8)  # two full pages
    requests = [Request(common + prompt(1), max_tokens=4),
                Request(common + prompt(5), Sampling(temperature=1.0), seed=5, max_tokens=4),
                Request(common + prompt(3), max_tokens=4)]
    requests.append(Request(requests[0].prompt, Sampling(temperature=1.0), seed=6, max_tokens=4))
    plain, shared = make_engine(model), make_engine(model, prefix_sharing=True)
    expected, got = plain.run(requests), shared.run(requests)
    for done, reference in zip(got, expected):
        assert done.tokens == reference.tokens
        np.testing.assert_allclose(done.logprobs, reference.logprobs, rtol=0, atol=1e-5)
    # The first prefills the common pages; the other three start from them.
    assert shared.stats.shared_tokens == 3 * len(common)
    assert shared.stats.prefill_tokens == plain.stats.prefill_tokens - 3 * len(common)
    assert shared.stats.pages_allocated == plain.stats.pages_allocated - 3 * len(common) // PAGE
    assert shared.stats.peak_pages <= plain.stats.peak_pages


def test_a_server_compiles_a_fixed_handful_of_programs(model, programs, alone, batched):
    before, warm = programs
    buckets = chunk_buckets(PAGE, CHUNK)
    assert buckets == (1, 2, 4)
    assert warm - before <= len(buckets) + 1 + 2  # prefill buckets, decode, prefix copies
    rng = np.random.default_rng(1)
    engine = make_engine(model, prefix_sharing=True)
    engine.run([Request(prompt(int(rng.integers(1, 16))),
                        Sampling(temperature=float(rng.uniform(0.5, 1.5)),
                                 top_k=int(rng.integers(1, 50)), top_p=float(rng.uniform(0.5, 1))),
                        seed=int(rng.integers(0, 2**32)), max_tokens=int(rng.integers(1, 8)))
                for _ in range(8)])
    assert compiled_programs() == warm


def test_steps_never_hash_the_model_structure(model, programs, monkeypatch):
    """jit hashes its static arguments at every call, and an nnx GraphDef hashes its whole node
    tree (milliseconds for a real model: more than a decode step's device time). The engine
    hashes its model's structure once, when it is built (`models.jit_split`), not per step."""
    hashes = []
    graphdef_hash = nnx.graphlib.GraphDef.__hash__
    monkeypatch.setattr(nnx.graphlib.GraphDef, "__hash__",
                        lambda self: hashes.append(1) or graphdef_hash(self))
    engine = make_engine(model)
    built = len(hashes)
    engine.submit(Request(prompt(6), max_tokens=5))
    while engine.has_work:
        engine.step()
    assert engine.stats.prefill_chunks and engine.stats.decode_steps == 5
    assert len(hashes) == built


def test_chunks_are_buckets_that_end_on_page_boundaries():
    buckets = chunk_buckets(4, 16)
    assert buckets == (1, 2, 4, 8, 16)
    for stop in range(1, 40):
        for fed in range(0, stop, 4):
            ends = [fed]
            while ends[-1] < stop:
                size = next_chunk(ends[-1], stop, 4, 16)
                assert size in buckets
                ends.append(ends[-1] + size)
            assert ends[-1] == stop
            boundary = stop // 4 * 4
            assert all(end % 4 == 0 for end in ends if end <= boundary)
            assert boundary in ends or boundary <= fed  # where the last full page's prefix is kept


def test_each_row_samples_with_its_own_parameters_and_key():
    # Rows 0 .. 3997: one seed, successive token indices, temperature 1 and top_k 2; row 3998
    # greedy (its top_k of 3 changes nothing); row 3999 top_k 1.
    rows = 4000
    logits = jnp.log(jnp.tile(jnp.array([0.2, 0.5, 0.3]), (rows, 1)))
    sampling = RowSampling(
        temperature=jnp.ones(rows).at[rows - 2].set(0.0),
        top_k=jnp.full(rows, 2, jnp.int32).at[rows - 2].set(3).at[rows - 1].set(1),
        top_p=jnp.ones(rows), seed=jnp.full(rows, 7, jnp.uint32),
        index=jnp.arange(rows, dtype=jnp.int32))
    tokens, logprobs = jax.jit(sample_rows)(logits, sampling)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    drawn = tokens[: rows - 2]
    np.testing.assert_allclose(np.bincount(drawn, minlength=3) / drawn.size, [0, 0.625, 0.375],
                               atol=0.03)
    np.testing.assert_allclose(logprobs[: rows - 2], np.log([1, 0.625, 0.375])[drawn], rtol=1e-5)
    np.testing.assert_array_equal(tokens[rows - 2 :], [1, 1])
    np.testing.assert_allclose(logprobs[rows - 2 :], [np.log(0.5), 0.0], atol=1e-6)


def test_bad_requests_and_engines_are_refused_naming_the_argument(model):
    engine = make_engine(model)
    refusals = [
        (lambda: engine.submit(Request(prompt(MAX_LEN))), "max_seq_len"),
        (lambda: engine.submit(Request((1, VOCAB))), "vocab_size"),
        (lambda: engine.submit(Request((1,), stop_tokens=(VOCAB,))), "stop_tokens"),
        (lambda: Request(()), "prompt"),
        (lambda: Request((1,), seed=-1), "seed"),
        (lambda: Request((1,), max_tokens=0), "max_tokens"),
        (lambda: Request((1,), sampling=Sampling(top_p=0.0)), "top_p"),
        (lambda: make_engine(model, max_prefixes=0), "max_prefixes"),
        (lambda: Engine(model, slots=1, num_pages=4, page_size=PAGE, max_seq_len=MAX_LEN,
                        prefill_chunk_tokens=12), "prefill_chunk_tokens"),
        (lambda: Engine(model, slots=1, num_pages=3, page_size=PAGE, max_seq_len=MAX_LEN
                        ).submit(Request(prompt(10), max_tokens=5)), "num_pages"),
    ]
    for refuse, name in refusals:
        with pytest.raises(ValueError, match=name):
            refuse()
    assert not engine.has_work  # nothing refused was queued


def test_a_shared_page_returns_to_the_free_list_with_its_last_holder():
    allocator = PageAllocator(num_pages=6, page_size=4, num_sequences=2, max_pages_per_seq=3)
    allocator.reserve(0, 8)  # two pages
    prefix = allocator.pages_of(0)
    allocator.retain(prefix)  # a kept prefix
    allocator.share(1, prefix)
    allocator.reserve(1, 12)  # one page of its own past the shared two
    assert allocator.num_free == 2 and allocator.pages_of(1)[:2] == prefix
    allocator.release(0)
    allocator.release(1)
    assert allocator.num_free == 3  # its own page; the prefix's are still held
    allocator.drop(prefix)
    assert allocator.num_free == 5 and (allocator.block_tables == NULL_PAGE).all()
    with pytest.raises(ValueError, match="not in use"):
        allocator.retain(prefix)


def first_pause(tokens: tuple[int, ...], prompt_length: int, pause: tuple[int, ...]) -> int:
    """How many tokens past the prompt a request generates before `pause` ends its tokens."""
    for end in range(prompt_length + 1, len(tokens) + 1):
        if tokens[max(end - len(pause), 0) : end] == pause:
            return end - prompt_length
    raise AssertionError("the pause sequence never ends the tokens")


def pausing(request: Request, done, at: int) -> tuple[Request, int]:
    """`request` pausing at its tokens (`done`) at..at+1, and how many tokens it pauses after."""
    pause = done.tokens[at : at + 2]
    paused = Request(request.prompt, request.sampling, seed=request.seed,
                     max_tokens=request.max_tokens, pause_sequences=(pause,))
    return paused, first_pause(request.prompt + done.tokens, len(request.prompt), pause)


def step_until_paused(engine: Engine, request_id: int) -> None:
    while request_id not in engine.paused:
        engine.step()


def test_a_paused_request_resumes_in_its_slot_prefilling_only_the_forced_tokens(model, alone):
    """A request paused at a two-token sequence keeps its slot while another runs; resumed with
    forced tokens, it prefills only those (the paused token and the forced ones before the
    last) and generates what a fresh request of the whole conversation would, keys continued."""
    engine = make_engine(model)
    request, end = pausing(REQUESTS[1], alone[1], at=1)
    paused_id = engine.submit(request)
    other_id = engine.submit(REQUESTS[3])
    step_until_paused(engine, paused_id)
    first = engine.completion(paused_id)
    assert first.finish_reason == "pause" and first.tokens == alone[1].tokens[:end]
    np.testing.assert_allclose(first.logprobs, alone[1].logprobs[:end], rtol=0, atol=1e-6)
    while engine.has_work:  # the other request runs to its end beside the paused one
        engine.step()
    assert engine.completion(other_id).tokens == alone[3].tokens
    assert engine.paused == (paused_id,) and engine.pages_in_use > 0
    forced = prompt(3)  # the paused request holds 15 tokens: it resumes within a page
    assert (len(request.prompt) + end - 1) % PAGE
    prefilled = engine.stats.prefill_tokens
    engine.resume(paused_id, forced, max_tokens=5)
    events = list(engine.stream())
    second = engine.completion(paused_id)
    assert engine.stats.prefill_tokens - prefilled == len(forced)
    assert [e.token for e in events] == list(second.tokens) and second.preemptions == 0
    whole = request.prompt + first.tokens + tuple(forced)
    fresh = make_engine(model).run([Request(
        whole, request.sampling, seed=request.seed, max_tokens=5,
        pause_sequences=request.pause_sequences, key_offset=len(whole) - len(request.prompt))])[0]
    assert second.tokens == fresh.tokens and second.finish_reason == fresh.finish_reason
    assert len(second.tokens) >= 2
    np.testing.assert_allclose(second.logprobs, fresh.logprobs, rtol=0, atol=1e-5)
    assert engine.pages_in_use == 0 and engine.paused == ()


def test_a_paused_request_gives_its_pages_up_first_and_is_recomputed(model, alone):
    """While one request is paused, four long ones need more pages than are free: the paused one
    is parked (its slot and pages freed) before any running one is preempted, the long ones give
    their tokens alone, and the resumed request recomputes its whole sequence, same tokens."""
    engine = make_engine(model)
    request, end = pausing(REQUESTS[3], alone[3], at=1)
    paused_id = engine.submit(request)
    step_until_paused(engine, paused_id)
    first = engine.completion(paused_id)
    long_done = engine.run(LONG)
    steps = engine.stats.steps
    for done, single in zip(long_done, alone[len(REQUESTS):]):
        assert done.tokens == single.tokens
    assert engine.pages_in_use == 0  # the paused request holds no page any more
    # nor a slot: three one-token requests all run in the next step
    assert len(engine.run([Request(REQUESTS[0].prompt, max_tokens=1)] * SLOTS)) == SLOTS
    assert engine.stats.steps - steps == 1
    forced = prompt(3)
    prefilled = engine.stats.prefill_tokens
    engine.resume(paused_id, forced, max_tokens=4)
    list(engine.stream())
    second = engine.completion(paused_id)
    assert second.preemptions >= 1
    assert engine.stats.prefill_tokens - prefilled == len(request.prompt) + end + len(forced) - 1
    whole = request.prompt + first.tokens + tuple(forced)
    fresh = make_engine(model).run([Request(
        whole, request.sampling, seed=request.seed, max_tokens=4,
        pause_sequences=request.pause_sequences, key_offset=len(whole) - len(request.prompt))])[0]
    assert second.tokens == fresh.tokens
    np.testing.assert_allclose(second.logprobs, fresh.logprobs, rtol=0, atol=1e-5)


def test_release_ends_a_request_wherever_it_is_and_paused_slots_are_named(model, alone):
    engine = make_engine(model)
    request = Request(REQUESTS[0].prompt, max_tokens=6, pause_sequences=(alone[0].tokens[:1],))
    paused = [engine.submit(request) for _ in range(SLOTS)]
    engine.step()  # one-token prompts: each generates its first token and pauses
    assert set(engine.paused) == set(paused) and not engine.has_work
    waiting = engine.submit(REQUESTS[0])
    with pytest.raises(RuntimeError, match="paused"):
        engine.step()
    engine.release(paused[0])
    engine.step()  # the waiting request takes the freed slot
    engine.release(waiting)  # running
    engine.release(paused[1])
    queued = engine.submit(REQUESTS[0])
    engine.release(queued)  # waiting
    engine.release(paused[2])
    assert not engine.has_work and engine.paused == () and engine.pages_in_use == 0
    for request_id in (waiting, paused[0], 99):
        with pytest.raises(ValueError, match="not waiting, running or paused"):
            engine.release(request_id)


def test_bad_pauses_and_resumes_are_refused_naming_the_argument(model, alone):
    engine = make_engine(model)
    request = Request(REQUESTS[0].prompt, max_tokens=6, pause_sequences=(alone[0].tokens[:1],))
    paused_id = engine.submit(request)
    engine.step()
    refusals = [
        (lambda: engine.resume(paused_id + 1, [1], 2), "not paused"),
        (lambda: engine.resume(paused_id, [VOCAB], 2), "forced"),
        (lambda: engine.resume(paused_id, [1], 0), "max_tokens"),
        (lambda: engine.resume(paused_id, prompt(MAX_LEN - 2), 2), "max_seq_len"),
        (lambda: Request((1,), pause_sequences=((),)), "pause_sequences"),
        (lambda: Request((1,), pause_sequences=((1.5,),)), "pause_sequences"),
        (lambda: engine.submit(Request((1,), pause_sequences=((VOCAB,),))), "pause_sequences"),
        (lambda: Request((1,), key_offset=-1), "key_offset"),
    ]
    for refuse, name in refusals:
        with pytest.raises(ValueError, match=name):
            refuse()
    assert engine.paused == (paused_id,)  # nothing refused changed it
    engine.release(paused_id)


def test_a_sequence_resumed_within_a_page_fills_it_first():
    for fed in range(1, 30):
        for stop in range(fed + 1, 40):
            ends = [fed]
            while ends[-1] < stop:
                size = next_chunk(ends[-1], stop, 4, 16)
                assert size in chunk_buckets(4, 16)
                ends.append(ends[-1] + size)
            assert ends[-1] == stop
            boundary = stop // 4 * 4
            first_boundary = -(-fed // 4) * 4
            assert all(end % 4 == 0 for end in ends if first_boundary <= end <= boundary)
            assert first_boundary > boundary or first_boundary in ends
