"""Synthetic recall tasks generated from a seed: MQAR, needle-in-a-haystack, multi-hop lookup.

Each task is a small frozen config; `task.generate(length, rng)` returns one example, a dict of

    tokens:      int32 [L]    starts with BOS_ID, byte ids and SEP_ID after it
    target_mask: float32 [L]  1 on the answer tokens, 0 elsewhere

`target_mask` marks tokens to be *predicted*: after packing, `loss_mask[t] = target_mask[t + 1]`
(see `train.packing`), so loss and accuracy count the answer positions only. `task_dataset` turns a
task into a grain `MapDataset` whose example i depends only on (seed, task, i): deterministic,
random-access and resumable, with no files.

- MQAR (Zoology's multi-query associative recall): key-value pairs up front (keys from bytes
  0..127, values from 128..255), then every key queried once at power-law distances in random
  noise from the values' half, each query followed by its value.
- Needle in a haystack: random lowercase "words" with one " KEY=123456." inserted at a chosen
  depth; the example ends with " KEY=" and the value to recall.
- Multi-hop lookup: shuffled one-token pairs a->b holding chains s0->s1->...->sH among
  distractors, random filler, then queries "s0 sH": answering needs H chained lookups.
"""

import dataclasses
import functools
import string
import zlib

import grain
import numpy as np

from train.tokenizer import BOS_ID, NUM_BYTES, SEP_ID

_HALF = NUM_BYTES // 2
_FILLER_ALPHABET = np.frombuffer((string.ascii_lowercase + " " * 5).encode(), np.uint8)
_KEY_ALPHABET = np.frombuffer(string.ascii_uppercase.encode(), np.uint8)
_DIGITS = np.frombuffer(string.digits.encode(), np.uint8)


def _example(tokens: np.ndarray, answer_positions: np.ndarray) -> dict[str, np.ndarray]:
    target_mask = np.zeros(tokens.shape, np.float32)
    target_mask[answer_positions] = 1.0
    return {"tokens": tokens.astype(np.int32), "target_mask": target_mask}


def _check_length(task, length: int) -> None:
    if length < task.min_length():
        raise ValueError(
            f"length={length} is too short for {task}: it needs at least {task.min_length()} "
            "tokens; raise the length (seq_len) or shrink the task"
        )


@dataclasses.dataclass(frozen=True)
class MQAR:
    """Multi-query associative recall as in Zoology (Arora et al., 2023).

    Two differences. The value follows its query key in the input, as in the context, where
    Zoology puts noise there and only labels it; the prediction made at the key is the same. And
    the noise between queries comes from the values' half only: Zoology draws it from a vocabulary
    of thousands, where a key rarely recurs, but with 256 bytes every key would recur in noise
    about once per 256 tokens, followed by a random byte, so at long lengths the latest
    occurrence of most keys would contradict the context.

    num_kv_pairs: pairs in the context, each queried once (at most 128: keys and values each come
        from one half of the byte range).
    power_a: exponent of the power law p(gap) ~ a * gap**(a - 1) that places the queries; small
        values put most queries soon after the context, with a long tail.
    """

    num_kv_pairs: int = 8
    power_a: float = 0.01

    def __post_init__(self):
        if not 1 <= self.num_kv_pairs <= _HALF:
            raise ValueError(f"MQAR.num_kv_pairs must lie in [1, {_HALF}], got {self.num_kv_pairs}")
        if not 0.0 < self.power_a <= 1.0:
            raise ValueError(f"MQAR.power_a must lie in (0, 1], got {self.power_a}; try 0.01")

    def chance_token_accuracy(self) -> float:
        """Answer token accuracy without recall: a guess among the 128 values."""
        return 1.0 / _HALF

    def min_length(self) -> int:
        # BOS, the pairs, and one two-token query slot per pair.
        return 1 + 4 * self.num_kv_pairs

    def generate(self, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        _check_length(self, length)
        num_pairs = self.num_kv_pairs
        keys = rng.choice(_HALF, num_pairs, replace=False)
        values = _HALF + rng.choice(_HALF, num_pairs, replace=False)
        tokens = rng.integers(_HALF, NUM_BYTES, length)  # noise: no byte of it reads as a key
        tokens[0] = BOS_ID
        tokens[1 : 1 + 2 * num_pairs : 2] = keys
        tokens[2 : 2 + 2 * num_pairs : 2] = values
        context_end = 1 + 2 * num_pairs
        num_slots = (length - context_end) // 2
        gaps = np.arange(1, num_slots + 1, dtype=np.float64)
        probs = self.power_a * gaps ** (self.power_a - 1.0)
        slots = rng.choice(num_slots, num_pairs, replace=False, p=probs / probs.sum())
        query_positions = context_end + 2 * slots
        tokens[query_positions] = keys
        tokens[query_positions + 1] = values
        return _example(tokens, query_positions + 1)


@dataclasses.dataclass(frozen=True)
class NeedleInHaystack:
    """One key=value needle in random lowercase text, recalled at the end.

    depth: where the needle sits, as the fraction of the haystack before it (0 = start, 1 = just
        before the question); None draws it uniformly per example.
    key_bytes: length of the uppercase key.
    value_bytes: number of digits in the value, all of them answer tokens.
    """

    depth: float | None = None
    key_bytes: int = 4
    value_bytes: int = 6

    def __post_init__(self):
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise ValueError(
                f"NeedleInHaystack.depth must lie in [0, 1] or be None, got {self.depth}"
            )
        if self.key_bytes < 1 or self.value_bytes < 1:
            raise ValueError(
                "NeedleInHaystack.key_bytes and value_bytes must be at least 1, got "
                f"{self.key_bytes} and {self.value_bytes}"
            )

    def chance_token_accuracy(self) -> float:
        """Answer token accuracy without recall: a guess among the ten digits (exact match:
        this to the power value_bytes)."""
        return 1.0 / _DIGITS.size

    def _needle_bytes(self) -> int:
        return self.key_bytes + self.value_bytes + 3  # " KEY=VALUE."

    def min_length(self) -> int:
        question = self.key_bytes + 2  # " KEY="
        return 1 + self._needle_bytes() + question + self.value_bytes

    def generate(self, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        _check_length(self, length)
        key = rng.choice(_KEY_ALPHABET, self.key_bytes)
        value = rng.choice(_DIGITS, self.value_bytes)
        space, equals, stop = (np.frombuffer(c, np.uint8) for c in (b" ", b"=", b"."))
        needle = np.concatenate([space, key, equals, value, stop])
        question = np.concatenate([space, key, equals])
        haystack = rng.choice(_FILLER_ALPHABET, length - 1 - question.size - value.size)
        depth = rng.random() if self.depth is None else self.depth
        start = round(depth * (haystack.size - needle.size))
        haystack[start : start + needle.size] = needle
        tokens = np.concatenate([[BOS_ID], haystack, question, value])
        return _example(tokens, np.arange(length - value.size, length))


@dataclasses.dataclass(frozen=True)
class MultiHop:
    """Multi-hop key-value lookup over one-token symbols (the 256 byte ids).

    num_pairs: pairs in the context: num_queries * num_hops chain links, the rest distractors.
    num_hops: lookups needed per query (1 is plain associative recall).
    num_queries: chains, each queried once at the end.
    """

    num_pairs: int = 32
    num_hops: int = 2
    num_queries: int = 4

    def __post_init__(self):
        if self.num_hops < 1 or self.num_queries < 1:
            raise ValueError(
                "MultiHop.num_hops and num_queries must be at least 1, got "
                f"{self.num_hops} and {self.num_queries}"
            )
        links = self.num_queries * self.num_hops
        symbols = self.num_queries * (self.num_hops + 1) + self.num_pairs - links
        if self.num_pairs < links or symbols > NUM_BYTES:
            raise ValueError(
                f"MultiHop.num_pairs={self.num_pairs} must hold the {links} chain links "
                f"(num_queries * num_hops) and need at most {NUM_BYTES} distinct symbols "
                f"(needs {symbols}); adjust num_pairs, num_hops or num_queries"
            )

    def chance_token_accuracy(self) -> float:
        """Answer token accuracy without recall: a guess among the 256 byte symbols."""
        return 1.0 / NUM_BYTES

    def min_length(self) -> int:
        # BOS, the pairs, SEP, (filler), SEP, two tokens per query.
        return 3 + 2 * self.num_pairs + 2 * self.num_queries

    def generate(self, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        _check_length(self, length)
        num_chain_symbols = self.num_queries * (self.num_hops + 1)
        num_distractors = self.num_pairs - self.num_queries * self.num_hops
        symbols = rng.permutation(NUM_BYTES)
        chains = symbols[:num_chain_symbols].reshape(self.num_queries, self.num_hops + 1)
        # Distractor keys are fresh symbols, so no chain can continue past its end.
        keys = np.concatenate(
            [chains[:, :-1].ravel(), symbols[num_chain_symbols:][:num_distractors]]
        )
        values = np.concatenate(
            [chains[:, 1:].ravel(), rng.integers(0, NUM_BYTES, num_distractors)]
        )
        order = rng.permutation(self.num_pairs)
        pairs = np.stack([keys[order], values[order]], axis=1).ravel()
        asked = chains[rng.permutation(self.num_queries)][:, [0, -1]].ravel()
        filler = rng.integers(0, NUM_BYTES, length - self.min_length())
        tokens = np.concatenate([[BOS_ID], pairs, [SEP_ID], filler, [SEP_ID], asked])
        return _example(tokens, np.arange(length - 2 * self.num_queries + 1, length, 2))


Task = MQAR | NeedleInHaystack | MultiHop


def _task_example(task: Task, length: int, seed: int, index: int) -> dict[str, np.ndarray]:
    # The task's type name keeps the streams of different tasks with one seed apart.
    stream = zlib.crc32(type(task).__name__.encode())
    return task.generate(length, np.random.default_rng([seed, stream, index]))


def task_dataset(task: Task, *, length: int, seed: int, num_examples: int) -> grain.MapDataset:
    """`num_examples` examples of exactly `length` tokens; example i depends on (seed, task, i)."""
    _check_length(task, length)
    if num_examples < 1:
        raise ValueError(f"num_examples must be at least 1, got {num_examples}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be a non-negative integer below 2**63, got {seed}")
    return grain.MapDataset.range(num_examples).map(
        functools.partial(_task_example, task, length, seed)
    )


def answer_accuracy(predictions, targets, loss_mask) -> dict[str, float]:
    """Accuracy on the answer positions of a batch of unpacked task examples (one per row).

    predictions: [B, T] predicted next-token ids (argmax of the logits).
    targets, loss_mask: [B, T] from the batch.
    Returns token_accuracy (over answer tokens) and exact_match (rows whose answers are all right,
    over rows that have answers).
    """
    predictions, targets = np.asarray(predictions), np.asarray(targets)
    answers = np.asarray(loss_mask) > 0
    if predictions.shape != targets.shape or answers.shape != targets.shape:
        raise ValueError(
            f"predictions {predictions.shape}, targets {targets.shape} and loss_mask "
            f"{answers.shape} must have one shape [B, T]"
        )
    if not answers.any():
        raise ValueError("loss_mask marks no answer positions; pass a batch of task examples")
    wrong = (predictions != targets) & answers
    rows = answers.any(axis=1)
    return {
        "token_accuracy": float(1.0 - wrong.sum() / answers.sum()),
        "exact_match": float((~wrong.any(axis=1))[rows].mean()),
    }
