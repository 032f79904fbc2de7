"""The byte vocabulary, the embedded stdlib corpus, user files and their errors, the split."""

import json
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.corpus import build_corpus, load_corpus, load_text_files, split_corpus, stdlib_corpus
from train.tokenizer import BOS_ID, PAD_ID, SEP_ID, VOCAB_SIZE, decode, encode


@settings(deadline=None, max_examples=15)
@given(st.text(max_size=50))
def test_encode_decode_round_trip(text):
    ids = encode(text)
    assert ids.dtype == np.int32 and ids[0] == BOS_ID
    assert ids.max(initial=0) < VOCAB_SIZE
    assert decode(ids) == "<bos>" + text
    assert decode(encode(text, bos=False)) == text


def test_decode_names_specials_and_rejects_out_of_range_ids():
    assert decode([104, 105, SEP_ID, PAD_ID]) == "hi<sep><pad>"
    with pytest.raises(ValueError, match=r"\[0, 264\)"):
        decode([VOCAB_SIZE])


def test_stdlib_corpus_is_real_text_and_cached():
    corpus = stdlib_corpus()
    start = time.perf_counter()
    assert load_corpus() is corpus  # cached: no second read
    assert time.perf_counter() - start < 0.1
    names = set(corpus.doc_names)
    assert corpus.num_documents > 1000 and corpus.num_bytes > 10_000_000
    assert "os.py" in names and "pydoc_data/topics/if" in names
    assert "pydoc_data/topics.py" not in names  # its text is already in the topic documents
    assert not any("site-packages" in name for name in names)
    assert list(corpus.doc_names) == sorted(names)
    assert corpus.offsets[0] == 0 and corpus.offsets[-1] == corpus.num_bytes
    assert (corpus.lengths > 0).all()
    assert b"\0" not in corpus.data.tobytes()
    corpus.document(corpus.doc_names.index("os.py")).tobytes().decode("utf-8")


def test_corpus_hash_depends_on_content_not_input_order():
    docs = [("b.txt", b"beta"), ("a.txt", b"alpha")]
    assert build_corpus("x", docs).sha256 == build_corpus("y", docs[::-1]).sha256
    assert (
        build_corpus("x", docs).sha256 != build_corpus("x", [docs[0], ("a.txt", b"alphA")]).sha256
    )
    # Name/content boundaries are part of the hash.
    assert build_corpus("x", [("ab", b"c")]).sha256 != build_corpus("x", [("a", b"bc")]).sha256


def test_split_is_whole_documents_disjoint_and_stable():
    corpus = stdlib_corpus()
    train = split_corpus(corpus, "train", 0.02)
    validation = split_corpus(corpus, "validation", 0.02)
    assert set(train.doc_names).isdisjoint(validation.doc_names)
    assert set(train.doc_names) | set(validation.doc_names) == set(corpus.doc_names)
    assert train.num_bytes + validation.num_bytes == corpus.num_bytes
    assert 0.005 < validation.num_documents / corpus.num_documents < 0.05
    # The draw depends on the name alone, so a larger fraction only adds documents.
    assert set(validation.doc_names) < set(split_corpus(corpus, "validation", 0.1).doc_names)
    name = validation.doc_names[0]
    np.testing.assert_array_equal(
        validation.document(0), corpus.document(corpus.doc_names.index(name))
    )


@pytest.mark.parametrize(
    ("data", "bits"),
    [(b"ab" * 50, 1.0), (b"zzzz", 0.0), (bytes(range(256)) * 3, 8.0), (b"aaab", 0.8112781)],
)
def test_unigram_entropy(data, bits):
    assert build_corpus("x", [("d", data)]).unigram_entropy_bits() == pytest.approx(bits, abs=1e-6)


def test_stdlib_unigram_entropy_is_that_of_code_and_english():
    assert 4.0 < split_corpus(stdlib_corpus(), "validation", 0.02).unigram_entropy_bits() < 5.5


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_user_text_and_jsonl_files(tmp_path):
    text = _write(tmp_path / "book.txt", "Call me Ishmael.\n")
    records = [{"text": "first"}, {"text": "zweite ü", "id": 7}, {"text": ""}]
    jsonl = _write(tmp_path / "docs.jsonl", "\n".join(json.dumps(r) for r in records) + "\n\n")
    corpus = load_text_files([text, jsonl])
    contents = {n: corpus.document(i).tobytes() for i, n in enumerate(corpus.doc_names)}
    # Empty documents are dropped; blank lines skipped.
    assert contents == {
        "book.txt": b"Call me Ishmael.\n",
        "docs.jsonl:1": b"first",
        "docs.jsonl:2": "zweite ü".encode(),
    }
    assert load_corpus([text, jsonl]) is corpus  # cached while the files are unchanged
    os.utime(text, ns=(0, 0))
    assert load_corpus([text, jsonl]) is not corpus


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.txt", None, r"'.*missing\.txt' does not exist.*pass an existing"),
        ("empty.txt", "", r"'.*empty\.txt' is empty"),
        ("empty.jsonl", "", r"'.*empty\.jsonl' is empty"),
        ("blank.jsonl", "\n\n", r"'.*blank\.jsonl' contains no text"),
        ("nofield.jsonl", '{"text": "ok"}\n{"body": "x"}\n', r"nofield\.jsonl', line 2 has no"),
        ("number.jsonl", '{"text": 3}\n', r"number\.jsonl', line 1 has no string 'text'"),
        (
            "broken.jsonl",
            '{"text": "ok"}\n{"text": \n',
            r"broken\.jsonl', line 2 is not valid JSON",
        ),
        ("list.jsonl", '["text"]\n', r"list\.jsonl', line 1 has no string 'text'"),
    ],
)
def test_bad_user_files_name_the_path_line_and_fix(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_text_files([str(path)])


def test_bad_paths_arguments(tmp_path):
    text = _write(tmp_path / "a.txt", "hello")
    with pytest.raises(ValueError, match="non-empty sequence"):
        load_text_files(text)
    with pytest.raises(ValueError, match="distinct names, each once"):
        load_text_files([text, text])
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="distinct names"):
        load_text_files([text, _write(tmp_path / "other" / "a.txt", "same name")])


def test_a_split_with_no_documents_says_how_to_fix_it(tmp_path):
    corpus = load_text_files([_write(tmp_path / "only.txt", "one document")])
    with pytest.raises(ValueError, match=r"split .* is empty .* give more"):
        for which in ("train", "validation"):
            split_corpus(corpus, which, 0.02)
    with pytest.raises(ValueError, match="val_fraction"):
        split_corpus(corpus, "train", 1.0)
    with pytest.raises(ValueError, match="split must be one of"):
        split_corpus(corpus, "test", 0.02)


def test_user_corpus_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    absolute = load_text_files([_write(tmp_path / "a.txt", "some text")])
    monkeypatch.chdir(tmp_path)
    relative = load_text_files(["a.txt"])
    assert relative is not absolute and relative.sha256 == absolute.sha256
