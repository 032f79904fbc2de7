"""Packing: rows, segment ids, positions, next-token targets that never cross a document, and
corpus chunks that cover every byte exactly once."""

import grain
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from train.corpus import build_corpus, load_corpus, split_corpus
from train.data import DataConfig, chunk_examples, chunk_table, make_eval_iterator
from train.packing import finalize_batch, pack_rows
from train.tokenizer import BOS_ID, PAD_ID


def test_finalize_batch_on_a_hand_packed_row():
    rows = {
        "tokens": np.array([[BOS_ID, 10, 11, BOS_ID, 20, 0, 0]]),
        "target_mask": np.array([[0, 1, 1, 0, 1, 0, 0]], np.float32),
        "tokens_segment_ids": np.array([[1, 1, 1, 2, 2, 0, 0]]),
        "tokens_positions": np.array([[0, 1, 2, 0, 1, 0, 0]]),
    }
    batch = finalize_batch(rows, batch_size=2)
    p = PAD_ID
    np.testing.assert_array_equal(batch["tokens"], [[BOS_ID, 10, 11, BOS_ID, 20, p, p], [p] * 7])
    np.testing.assert_array_equal(batch["targets"], [[10, 11, p, 20, p, p, p], [p] * 7])
    np.testing.assert_array_equal(batch["loss_mask"], [[1, 1, 0, 1, 0, 0, 0], [0] * 7])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 2, 2, 0, 0], [0] * 7])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 0, 1, 0, 0], [0] * 7])
    assert {k: v.dtype for k, v in batch.items()} == {
        "tokens": np.int32,
        "targets": np.int32,
        "loss_mask": np.float32,
        "segment_ids": np.int32,
        "positions": np.int32,
    }


def _documents(lengths, seed):
    """Documents [BOS, distinct ids...] whose first content token names the document."""
    rng = np.random.default_rng(seed)
    return [
        np.concatenate([[BOS_ID], [i], rng.integers(0, 256, n - 2)]).astype(np.int32)
        for i, n in enumerate(lengths)
    ]


def _pack(documents, seq_len, bins, seed, batch_size):
    examples = grain.MapDataset.source(documents).map(
        lambda t: {"tokens": t, "target_mask": (np.arange(t.size) > 0).astype(np.float32)}
    )
    rows = pack_rows(examples.to_iter_dataset(), seq_len=seq_len, num_bins=bins, seed=seed)
    batched = rows.batch(batch_size).map(lambda r: finalize_batch(r, batch_size=batch_size))
    return list(batched)


@settings(deadline=None, max_examples=15)
@given(
    seq_len=st.sampled_from([16, 40]),
    bins=st.sampled_from([1, 3, 8]),
    lengths=st.lists(st.integers(2, 16), min_size=1, max_size=60),
    seed=st.integers(0, 1000),
)
def test_packing_keeps_every_document_whole_and_segments_consistent(seq_len, bins, lengths, seed):
    documents = _documents(lengths, seed)
    batches = _pack(documents, seq_len, bins, seed, batch_size=4)
    recovered = []
    for batch in batches:
        for row in range(4):
            segments = batch["segment_ids"][row]
            occupied = segments > 0
            # Segments are numbered 1, 2, ... from the left; empty slots only at the end.
            assert (np.diff(segments[occupied]) >= 0).all()
            assert occupied[: occupied.sum()].all()
            assert np.unique(segments[occupied]).tolist() == list(range(1, segments.max() + 1))
            assert (batch["tokens"][row][~occupied] == PAD_ID).all()
            assert (batch["loss_mask"][row][~occupied] == 0).all()
            for segment in range(1, segments.max() + 1):
                where = np.flatnonzero(segments == segment)
                tokens = batch["tokens"][row][where]
                np.testing.assert_array_equal(batch["positions"][row][where], np.arange(where.size))
                # Targets are the next tokens of this document; the last one predicts nothing.
                np.testing.assert_array_equal(batch["targets"][row][where[:-1]], tokens[1:])
                assert batch["loss_mask"][row][where].tolist() == [1.0] * (where.size - 1) + [0.0]
                recovered.append(tokens)
    assert len(recovered) == len(documents)
    by_name = {int(tokens[1]): tokens for tokens in recovered}
    for i, document in enumerate(documents):
        np.testing.assert_array_equal(by_name[i], document)


def test_packing_is_deterministic_and_shuffled_by_seed():
    documents = _documents([5, 9, 3, 12, 7, 4, 6, 11, 2, 8] * 4, seed=0)
    first = _pack(documents, 16, 8, seed=1, batch_size=4)
    again = _pack(documents, 16, 8, seed=1, batch_size=4)
    other = _pack(documents, 16, 8, seed=2, batch_size=4)
    tokens = lambda batches: np.concatenate([b["tokens"] for b in batches])  # noqa: E731
    np.testing.assert_array_equal(tokens(first), tokens(again))
    assert not np.array_equal(tokens(first), tokens(other))
    assert sorted(map(bytes, tokens(first))) == sorted(map(bytes, tokens(other)))


@settings(deadline=None, max_examples=15)
@given(
    seq_len=st.sampled_from([2, 5, 64]),
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=8),
)
def test_chunks_tile_each_document_with_one_token_of_overlap(seq_len, lengths):
    rng = np.random.default_rng(0)
    corpus = build_corpus(
        "t",
        [
            (f"d{i}", rng.integers(0, 256, n).astype(np.uint8).tobytes())
            for i, n in enumerate(lengths)
        ],
    )
    documents, starts = chunk_table(corpus, seq_len)
    example = chunk_examples(corpus, seq_len)
    targets_per_document = {i: [] for i in range(corpus.num_documents)}
    for chunk, document in enumerate(documents):
        tokens, mask = example(chunk)["tokens"], example(chunk)["target_mask"]
        assert 2 <= tokens.size <= seq_len and mask.tolist() == [0.0] + [1.0] * (tokens.size - 1)
        stream = np.concatenate([[BOS_ID], corpus.document(document)])
        np.testing.assert_array_equal(tokens, stream[starts[chunk] : starts[chunk] + tokens.size])
        targets_per_document[document].extend(tokens[1:].tolist())
    for i in range(corpus.num_documents):
        assert targets_per_document[i] == corpus.document(i).tolist()


def test_a_validation_pass_predicts_every_validation_byte_once(tmp_path):
    texts = {f"doc{i}.txt": f"document {i} " * (i * 7 + 1) for i in range(40)}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    cfg = DataConfig(
        seq_len=32, batch_size=4, paths=tuple(str(tmp_path / n) for n in texts), val_fraction=0.3
    )
    validation = split_corpus(load_corpus(cfg.paths), "validation", cfg.val_fraction)
    batches = list(make_eval_iterator(cfg))
    assert all(b["tokens"].shape == (4, 32) for b in batches)
    counts = np.zeros(256)
    for batch in batches:
        np.add.at(counts, batch["targets"][batch["loss_mask"] > 0], 1)
    expected = np.bincount(validation.data, minlength=256)
    np.testing.assert_array_equal(counts, expected)
    again = list(make_eval_iterator(cfg, max_batches=2))
    assert len(again) == 2
    np.testing.assert_array_equal(again[1]["tokens"], batches[1]["tokens"])
