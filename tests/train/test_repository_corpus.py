"""The repository corpus: one document per package tree, built deterministically from a fake
installation (the real one in one slow test), split whole, and cut into rows of any length."""

import platform
import re

import numpy as np
import pytest

import train.corpus
from train.corpus import (
    build_repository_corpus,
    load_corpus,
    longest_documents,
    repository_corpus,
    split_corpus,
)
from train.data import DataConfig, make_eval_iterator, make_train_iterator
from train.tokenizer import BOS_ID

# (root label, path relative to the root) -> content; what the corpus must keep of a fake install.
SOURCES = {
    ("std", "json/__init__.py"): b"from json.decoder import JSONDecoder\n",
    ("std", "json/decoder.py"): b"class JSONDecoder:\n    pass\n",
    ("std", "json/tests/test_json.py"): b"def test():\n    assert True",  # no final newline
    ("std", "json/README.md"): "# json ü\n".encode(),
    ("std", "json/empty.py"): b"",
    ("std", "email/_parseaddr.py"): b"def parse(text):\n    return text\n",
    ("site", "alpha/__init__.py"): b"VERSION = '1.0'\n",
    ("site", "alpha/core/ops.pyi"): b"def op(x: int) -> int: ...\n",
    ("site", "alpha/core/kernel.c"): b"int op(int x) { return x; }\n",
    ("site", "beta/beta.py"): b"import alpha\n" * 50,
}
# What it must leave out: other suffixes, binaries, non-UTF-8 text, single modules, metadata.
OTHERS = {
    ("std", "os.py"): b"import posix\n",
    ("std", "json/data.csv"): b"a,b\n1,2\n",
    ("std", "json/__pycache__/decoder.cpython-312.pyc"): b"\x00\x01binary",
    ("std", "json/zero.py"): b"x = 1\x00\n",
    ("std", "json/latin.txt"): "café\n".encode("latin-1"),
    ("std", "site-packages/gamma/__init__.py"): b"nested install\n",
    ("site", "alpha-1.0.dist-info/METADATA.txt"): b"Name: alpha\n",
    ("site", "alpha.libs/libalpha.so"): b"\x7fELF",
    ("site", "six.py"): b"PY3 = True\n",
}
PACKAGES = ("site/alpha", "site/beta", "std/email", "std/json")


def _write_tree(base, files, reverse=False):
    """Write {(label, path): content} under base/label, in reverse order on request (directory
    listings then come back in another order); returns the (label, root) pairs."""
    for (label, relative), content in sorted(files.items(), reverse=reverse):
        path = base / label / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return tuple((label, str(base / label)) for label in sorted({label for label, _ in files}))


@pytest.fixture
def roots(tmp_path):
    return _write_tree(tmp_path / "install", {**SOURCES, **OTHERS})


def _text(corpus, name):
    return corpus.document(corpus.doc_names.index(name)).tobytes()


def test_one_document_per_package_tree(roots):
    corpus = build_repository_corpus(roots)
    assert corpus.doc_names == PACKAGES
    assert corpus.name.startswith(f"repositories-{platform.python_version()}-")


def test_every_source_file_once_after_its_header_in_sorted_order(roots):
    corpus = build_repository_corpus(roots)
    for name in PACKAGES:
        label, package = name.split("/")
        files = sorted(path for lab, path in SOURCES
                       if lab == label and path.startswith(package + "/"))
        text = _text(corpus, name)
        assert re.findall(rb"^# file: (.*)$", text, re.MULTILINE) == [f.encode() for f in files]
        expected_size = 0
        for path in files:
            content = SOURCES[label, path]
            block = f"# file: {path}\n".encode() + content
            assert text.count(block) == 1, path
            newline_added = content and not content.endswith(b"\n")
            expected_size += len(block) + (1 if newline_added else 0)
        assert len(text) == expected_size  # nothing else: no left-out file, no duplicate
    assert _text(corpus, "std/json").endswith(b"# file: json/tests/test_json.py\n"
                                              b"def test():\n    assert True\n")


def test_same_bytes_and_hash_on_every_build_and_machine(tmp_path, roots):
    first, second = build_repository_corpus(roots), build_repository_corpus(roots)
    assert first is not second and first.sha256 == second.sha256
    np.testing.assert_array_equal(first.data, second.data)
    # Another place, files written in the opposite order: the same corpus.
    elsewhere = _write_tree(tmp_path / "elsewhere", {**SOURCES, **OTHERS}, reverse=True)
    moved = build_repository_corpus(elsewhere)
    assert (moved.sha256, moved.name) == (first.sha256, first.name)
    np.testing.assert_array_equal(moved.data, first.data)
    # A changed file changes the hash; another installed version changes the name.
    (tmp_path / "elsewhere" / "site" / "beta" / "beta.py").write_bytes(b"import alpha\n")
    (tmp_path / "elsewhere" / "site" / "alpha-1.0.dist-info").rename(
        tmp_path / "elsewhere" / "site" / "alpha-1.1.dist-info")
    changed = build_repository_corpus(elsewhere)
    assert changed.sha256 != first.sha256 and changed.name != first.name


def test_bad_roots_are_refused(tmp_path, roots):
    with pytest.raises(ValueError, match="not a directory"):
        build_repository_corpus((("std", str(tmp_path / "nowhere")),))
    with pytest.raises(ValueError, match="distinct labels"):
        build_repository_corpus((roots[0], roots[0]))
    with pytest.raises(ValueError, match="embedded corpus must be one of"):
        load_corpus((), "wikipedia")


def test_longest_documents_longest_first():
    corpus = train.corpus.build_corpus("x", [("a", b"12"), ("b", b"1234"), ("c", b"1234"),
                                             ("d", b"1")])
    assert longest_documents(corpus, 3) == (("b", 4), ("c", 4), ("a", 2))
    assert longest_documents(corpus, 10)[-1] == ("d", 1)
    with pytest.raises(ValueError, match="count must be at least 1"):
        longest_documents(corpus, 0)


def _many_packages(tmp_path, count):
    """A fake site-packages of `count` package trees, each file naming its package."""
    files = {}
    for index in range(count):
        for module in ("__init__", "core", "utils"):
            line = f"# package pkg{index:03d}, module {module}\n"
            files["site", f"pkg{index:03d}/{module}.py"] = (line * (20 + 7 * index)).encode()
    return _write_tree(tmp_path / "many", files)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The repository corpus of DataConfig(corpus="repositories") is a fake of 60 packages."""
    monkeypatch.setattr(train.corpus, "installed_roots", lambda: _many_packages(tmp_path, 60))
    repository_corpus.cache_clear()
    yield repository_corpus()
    repository_corpus.cache_clear()


def _packages_in(batch):
    """The package names written in the batch's segments (each segment one chunk)."""
    found = set()
    for tokens, segments in zip(batch["tokens"], batch["segment_ids"], strict=True):
        for segment in np.unique(segments[segments > 0]):
            text = tokens[(segments == segment) & (tokens < 256)].astype(np.uint8).tobytes()
            found |= {name.decode() for name in re.findall(rb"pkg\d{3}", text)}
    return found


def test_the_split_never_divides_a_repository(installed):
    corpus = installed
    train_split = split_corpus(corpus, "train", 0.1)
    validation = split_corpus(corpus, "validation", 0.1)
    assert train_split.num_documents > 0 and validation.num_documents > 0
    assert set(train_split.doc_names).isdisjoint(validation.doc_names)
    assert set(train_split.doc_names) | set(validation.doc_names) == set(corpus.doc_names)
    for split in (train_split, validation):
        for index, name in enumerate(split.doc_names):
            assert split.document(index).tobytes() == _text(corpus, name)  # whole, never cut
    # The pipeline of DataConfig(corpus="repositories") reads only its own split's packages.
    held_out = {name.removeprefix("site/") for name in validation.doc_names}
    cfg = DataConfig(corpus="repositories", seq_len=512, batch_size=4, val_fraction=0.1)
    iterator = make_train_iterator(cfg)
    trained = set().union(*(_packages_in(next(iterator)) for _ in range(20)))
    assert len(trained) > 10 and trained.isdisjoint(held_out)
    evaluated = set().union(*(_packages_in(b) for b in make_eval_iterator(cfg)))
    assert evaluated == held_out


@pytest.mark.parametrize("seq_len", [2, 97, 4096])
def test_rows_of_any_length_are_one_repository(installed, seq_len):
    cfg = DataConfig(corpus="repositories", seq_len=seq_len, batch_size=2, val_fraction=0.1,
                     long_document_bias=1.0, packing_bins=2)
    documents = split_corpus(installed, "train", 0.1)
    for batch in (next(make_train_iterator(cfg)) for _ in range(2)):
        for row in range(2):
            assert (batch["segment_ids"][row] == 1).all()  # one chunk fills the row
            assert_row_is_a_slice(batch["tokens"][row], documents)


def assert_row_is_a_slice(tokens, corpus):
    """tokens [T]: BOS and then a document's first bytes, or T bytes from inside one document."""
    starts_document = tokens[0] == BOS_ID
    body = (tokens[1:] if starts_document else tokens).astype(np.uint8).tobytes()
    documents = (corpus.document(i).tobytes() for i in range(corpus.num_documents))
    if starts_document:
        assert any(document.startswith(body) for document in documents)
    else:
        assert any(body in document for document in documents)


def test_datacfg_refuses_an_unknown_corpus_and_paths_with_repositories():
    with pytest.raises(ValueError, match=r"corpus must be one of \('stdlib', 'repositories'\)"):
        DataConfig(corpus="wikipedia")
    with pytest.raises(ValueError, match="give paths or corpus, not both"):
        DataConfig(corpus="repositories", paths=("notes.txt",))


@pytest.mark.slow
def test_the_installation_has_repositories_longer_than_a_million_bytes():
    corpus = repository_corpus()
    assert repository_corpus() is corpus  # cached
    assert "site-packages/numpy" in corpus.doc_names and "stdlib/email" in corpus.doc_names
    assert not any(name.endswith((".dist-info", "__pycache__")) for name in corpus.doc_names)
    assert b"# file: json/decoder.py\n" in _text(corpus, "stdlib/json")
    train_split = split_corpus(corpus, "train", 0.02)
    assert split_corpus(corpus, "validation", 0.02).num_documents > 0
    seq_len = 1 << 20
    assert longest_documents(train_split, 1)[0][1] >= seq_len - 1
    cfg = DataConfig(corpus="repositories", seq_len=seq_len, batch_size=1,
                     long_document_bias=1.0, packing_bins=1)
    iterator = make_train_iterator(cfg)
    for batch in (next(iterator) for _ in range(2)):
        assert batch["tokens"].shape == (1, seq_len)
        assert (batch["segment_ids"] == 1).all() and batch["loss_mask"].sum() == seq_len - 1
        assert_row_is_a_slice(batch["tokens"][0], train_split)
