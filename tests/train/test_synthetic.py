"""Synthetic tasks: exact lengths, determinism, answers that follow from the context, errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.data import make_task_batches
from train.synthetic import MQAR, MultiHop, NeedleInHaystack, answer_accuracy, task_dataset
from train.tokenizer import BOS_ID, SEP_ID

TASKS = [MQAR(num_kv_pairs=6), NeedleInHaystack(), NeedleInHaystack(depth=0.5), MultiHop()]


@pytest.mark.parametrize("task", TASKS, ids=repr)
@settings(deadline=None, max_examples=10)
@given(length=st.sampled_from([100, 257]), seed=st.integers(0, 2**40), index=st.integers(0, 10**6))
def test_examples_are_deterministic_full_length_and_have_answers(task, length, seed, index):
    dataset = task_dataset(task, length=length, seed=seed, num_examples=index + 2)
    example = dataset[index]
    assert example["tokens"].shape == example["target_mask"].shape == (length,)
    assert example["tokens"].dtype == np.int32 and example["target_mask"].dtype == np.float32
    assert example["tokens"][0] == BOS_ID and example["target_mask"][0] == 0
    assert set(np.unique(example["target_mask"])) == {0.0, 1.0}
    again = task_dataset(task, length=length, seed=seed, num_examples=index + 2)[index]
    np.testing.assert_array_equal(example["tokens"], again["tokens"])
    assert not np.array_equal(example["tokens"], dataset[index + 1]["tokens"])


def _example(task, length=200, index=0):
    return task_dataset(task, length=length, seed=3, num_examples=index + 1)[index]


def test_mqar_answers_are_the_values_of_the_queried_keys():
    task = MQAR(num_kv_pairs=8)
    for index in range(5):
        example = _example(task, index=index)
        tokens = example["tokens"]
        context = dict(zip(tokens[1:17:2].tolist(), tokens[2:18:2].tolist(), strict=True))
        assert len(context) == 8 and all(k < 128 <= v < 256 for k, v in context.items())
        answers = np.flatnonzero(example["target_mask"])
        assert len(answers) == 8 and (answers > 17).all()
        assert sorted(tokens[answers - 1].tolist()) == sorted(context)  # every key asked once
        assert all(
            context[k] == v for k, v in zip(tokens[answers - 1], tokens[answers], strict=True)
        )


def test_mqar_noise_never_holds_a_key():
    # With 256 bytes, noise drawn from all of them would repeat each key about once per 256
    # tokens, followed by a random byte: the latest occurrence would contradict the context.
    for index in range(5):
        example = _example(MQAR(num_kv_pairs=8), length=1024, index=index)
        tokens = example["tokens"]
        answers = np.flatnonzero(example["target_mask"])
        noise = np.ones(tokens.size, bool)
        noise[:17] = False
        noise[np.concatenate([answers - 1, answers])] = False
        assert (tokens[noise] >= 128).all()


@pytest.mark.parametrize("task", TASKS, ids=repr)
def test_chance_is_one_over_the_answers_equally_likely_without_context(task):
    examples = task_dataset(task, length=100, seed=1, num_examples=3000)
    answers = np.concatenate([example["tokens"][example["target_mask"] > 0]
                              for example in examples])
    frequencies = np.bincount(answers) / answers.size
    frequencies = frequencies[frequencies > 0]
    # Uniform over the alphabet: the perplexity of the answers is its size.
    assert frequencies.size == round(1 / task.chance_token_accuracy())
    perplexity = np.exp(-(frequencies * np.log(frequencies)).sum())
    assert perplexity == pytest.approx(frequencies.size, rel=0.03)


@pytest.mark.parametrize("depth", [0.0, 0.25, 1.0])
def test_needle_sits_at_its_depth_and_is_the_answer(depth):
    example = _example(NeedleInHaystack(depth=depth, key_bytes=4, value_bytes=6), length=300)
    text = bytes(example["tokens"][1:].astype(np.uint8).tolist()).decode("ascii")
    answers = np.flatnonzero(example["target_mask"])
    assert answers.tolist() == list(range(294, 300))
    value = text[-6:]
    key = text[-11:-7]
    assert value.isdigit() and key.isupper() and text[-12:-6] == f" {key}="
    needle = f" {key}={value}."
    haystack = text[:-12]
    assert haystack.count(needle) == 1 and haystack.replace(needle, "").islower()
    assert haystack.index(needle) == round(depth * (len(haystack) - len(needle)))


@pytest.mark.parametrize("hops", [1, 3])
def test_multihop_answers_follow_the_chain(hops):
    task = MultiHop(num_pairs=20, num_hops=hops, num_queries=3)
    example = _example(task, length=120)
    tokens = example["tokens"].tolist()
    pairs = tokens[1:41]
    lookup = dict(zip(pairs[0::2], pairs[1::2], strict=True))
    assert len(lookup) == 20  # keys are distinct
    assert tokens[41] == SEP_ID and tokens[-7] == SEP_ID
    answers = np.flatnonzero(example["target_mask"]).tolist()
    assert answers == [115, 117, 119]
    for position in answers:
        symbol = tokens[position - 1]
        for _ in range(hops):
            symbol = lookup[symbol]
        assert symbol == tokens[position] and symbol not in lookup  # the chain ends there


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MQAR(num_kv_pairs=129), "num_kv_pairs must lie in"),
        (lambda: MQAR(power_a=0.0), "power_a"),
        (lambda: NeedleInHaystack(depth=1.5), "depth must lie in"),
        (lambda: NeedleInHaystack(value_bytes=0), "at least 1"),
        (lambda: MultiHop(num_pairs=3, num_hops=2, num_queries=2), "must hold the 4 chain links"),
        (lambda: MultiHop(num_pairs=255, num_hops=3, num_queries=4), "at most 256 distinct"),
        (
            lambda: task_dataset(MQAR(num_kv_pairs=8), length=32, seed=0, num_examples=1),
            "length=32 is too short .* at least 33",
        ),
        (lambda: task_dataset(MultiHop(), length=20, seed=0, num_examples=1), "too short"),
        (lambda: task_dataset(MQAR(), length=64, seed=0, num_examples=0), "num_examples"),
    ],
)
def test_bad_task_settings_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_task_batches_and_answer_accuracy():
    batches = make_task_batches(MQAR(num_kv_pairs=4), seq_len=64, batch_size=3, num_batches=2)
    assert len(batches) == 2
    batch = batches[1]
    assert batch["tokens"].shape == (3, 64)
    assert (batch["segment_ids"] == 1).all()
    np.testing.assert_array_equal(batch["positions"], np.tile(np.arange(64), (3, 1)))
    assert batch["loss_mask"].sum(axis=1).tolist() == [4.0, 4.0, 4.0]
    targets, mask = batch["targets"], batch["loss_mask"]
    assert answer_accuracy(targets, targets, mask) == {"token_accuracy": 1.0, "exact_match": 1.0}
    wrong = targets.copy()
    wrong[0, np.flatnonzero(mask[0])[0]] += 1
    wrong[:, mask.sum(axis=0) == 0] = 0  # non-answer positions do not count
    assert answer_accuracy(wrong, targets, mask) == {
        "token_accuracy": pytest.approx(11 / 12),
        "exact_match": pytest.approx(2 / 3),
    }
    with pytest.raises(ValueError, match="no answer positions"):
        answer_accuracy(targets, targets, np.zeros_like(mask))
