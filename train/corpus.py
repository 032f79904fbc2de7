"""Document corpora held in memory as one byte buffer: the embedded corpora and user files.

The default corpus needs no download: it is every `.py` file of the running interpreter's standard
library (UTF-8 text only, `site-packages` excluded) plus each `pydoc_data` help topic as its own
document. That is real code and English documentation, about 32 MB and 1,800 documents on
CPython 3.12. The "repositories" corpus is the long-context one, also from what is installed: one
document per top-level package tree of the standard library and of site-packages (numpy, jax,
email, asyncio, ...), its source and documentation files (`SOURCE_SUFFIXES`, UTF-8 text only)
concatenated in sorted path order, each after a `# file: json/decoder.py` header line. Its
documents run from a few KB to tens of MB, so one document can fill a row of 1,048,576 tokens.
User data is plain-text files (one document per file) or JSONL files (one document per line, in
its `text` field).

Documents are split into train and validation by a hash of their name, so the split is the same on
every run and machine and never cuts a document in two. Each corpus carries a sha256 over its
sorted document names and contents; record it with a run, because the standard library differs
between Python patch releases.
"""

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import platform
import sysconfig
import typing
import warnings
from collections.abc import Sequence
from typing import Literal
from pydoc_data import topics

import numpy as np

from train.tokenizer import NUM_BYTES

SPLITS = ("train", "validation")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
EmbeddedCorpus = Literal["stdlib", "repositories"]
EMBEDDED_CORPORA = typing.get_args(EmbeddedCorpus)
# What a package tree's author wrote: code, stubs, C sources, docs and configuration. Data tables
# (.csv, .dat, .json), fonts and binaries are left out.
SOURCE_SUFFIXES = (
    ".py", ".pyi", ".pyx", ".pxd", ".pxi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh",
    ".txt", ".md", ".rst", ".toml", ".cfg", ".ini", ".yaml", ".yml",
)
# Top-level directories that hold install metadata, bundled libraries or byte code, not a package.
_NOT_PACKAGE_SUFFIXES = (".dist-info", ".egg-info", ".libs", ".data")
_NOT_PACKAGES = ("__pycache__", "site-packages")


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Documents stored back to back in one byte array.

    name: where the documents came from, e.g. "stdlib-3.12.1" or "stdlib-3.12.1/validation".
    doc_names: [D] document ids (paths relative to the stdlib, file paths, or "file:line"), sorted.
    data: uint8 [N] all documents concatenated; the bytes are the token ids.
    offsets: int64 [D + 1]; document i is data[offsets[i]:offsets[i + 1]].
    sha256: hex digest over the sorted names and contents (`_sha256`).
    """

    name: str
    doc_names: tuple[str, ...]
    data: np.ndarray
    offsets: np.ndarray
    sha256: str

    @property
    def num_documents(self) -> int:
        return len(self.doc_names)

    @property
    def num_bytes(self) -> int:
        return int(self.data.size)

    @property
    def lengths(self) -> np.ndarray:
        """int64 [D] document lengths in bytes."""
        return np.diff(self.offsets)

    def document(self, index: int) -> np.ndarray:
        """uint8 [len] bytes of document `index` (a view, not a copy)."""
        return self.data[self.offsets[index] : self.offsets[index + 1]]

    def unigram_entropy_bits(self) -> float:
        """Order-0 entropy of the byte distribution in bits per byte.

        The bits per byte of the best model that ignores context; a trained model should be far
        below it.
        """
        # Counting 1 MiB at a time stays in cache: several times faster than one bincount.
        block = 1 << 20
        counts = sum(
            np.bincount(self.data[start : start + block], minlength=NUM_BYTES)
            for start in range(0, self.num_bytes, block)
        ).astype(np.float64)
        probs = counts[counts > 0] / counts.sum()
        return float(-(probs * np.log2(probs)).sum())


def _sha256(documents: Sequence[tuple[str, bytes]]) -> str:
    """Digest of (name, content) pairs in the given (sorted) order; lengths make it unambiguous."""
    digest = hashlib.sha256()
    for name, content in documents:
        encoded_name = name.encode("utf-8")
        digest.update(len(encoded_name).to_bytes(8, "little") + encoded_name)
        digest.update(len(content).to_bytes(8, "little") + content)
    return digest.hexdigest()


def build_corpus(name: str, documents: Sequence[tuple[str, bytes]]) -> Corpus:
    """A `Corpus` from (document name, content) pairs; empty documents are dropped.

    Raises ValueError on a repeated document name or when no document has any content.
    """
    kept = sorted((doc_name, content) for doc_name, content in documents if content)
    names = [doc_name for doc_name, _ in kept]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"corpus {name!r}: document names must be unique, got {repeated[:3]} more than once; "
            "data files are named by their base name, so pass files with distinct names, each once"
        )
    if not kept:
        raise ValueError(f"corpus {name!r} has no non-empty documents; give it some text")
    lengths = np.array([len(content) for _, content in kept], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    data = np.frombuffer(b"".join(content for _, content in kept), dtype=np.uint8)
    return Corpus(name, tuple(names), data, offsets, _sha256(kept))


def _not_text_reason(content: bytes) -> str | None:
    """Why `content` is not UTF-8 text (a NUL byte, or the first invalid byte), or None if it is."""
    if b"\0" in content:
        return f"it has a NUL byte at offset {content.index(0)}"
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"it is not UTF-8 (byte {content[error.start]:#04x} at offset {error.start})"
    return None


def _is_text(content: bytes) -> bool:
    return _not_text_reason(content) is None


@functools.cache
def stdlib_corpus() -> Corpus:
    """The embedded default corpus: this interpreter's standard library sources and help topics.

    Cached: the first call reads the files (about a second), later calls return the same object.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    # topics.py holds the same text as the per-topic documents below; keeping both would leak
    # validation topics into training.
    skipped = {"pydoc_data/topics.py"}
    documents = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts or relative.as_posix() in skipped:
            continue
        content = path.read_bytes()
        if _is_text(content):
            documents.append((relative.as_posix(), content))
    documents += [
        (f"pydoc_data/topics/{topic}", text.encode("utf-8"))
        for topic, text in topics.topics.items()
    ]
    return build_corpus(f"stdlib-{platform.python_version()}", documents)


def installed_roots() -> tuple[tuple[str, str], ...]:
    """(label, directory) of the interpreter's standard library and its site-packages."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", paths["stdlib"]), ("site-packages", paths["purelib"])]
    if os.path.realpath(paths["platlib"]) != os.path.realpath(paths["purelib"]):
        roots.append(("site-packages-platlib", paths["platlib"]))
    return tuple(roots)


def package_trees(root: str) -> list[str]:
    """Sorted names of the top-level directories of `root` that can hold a package.

    Single-module files (os.py, six.py) are not trees and are left out; so are metadata and
    bundled-library directories (`_NOT_PACKAGE_SUFFIXES`) and a nested site-packages.
    """
    return sorted(
        entry.name
        for entry in os.scandir(root)
        if entry.is_dir()
        and entry.name not in _NOT_PACKAGES
        and not entry.name.endswith(_NOT_PACKAGE_SUFFIXES)
    )


def package_files(root: str, package: str) -> list[str]:
    """Sorted paths (relative to `root`, with "/") of the source files under root/package."""
    files = []
    for directory, _, names in os.walk(os.path.join(root, package)):
        relative = pathlib.Path(directory).relative_to(root)
        files += [(relative / name).as_posix() for name in names if name.endswith(SOURCE_SUFFIXES)]
    return sorted(files)


def repository_document(root: str, package: str) -> bytes:
    """One package tree as one document: each text file after a "# file: <path>" header line.

    Files come in sorted path order and end with a newline (one is added where missing), so the
    next header starts a line. Files that are not UTF-8 text (`_is_text`) are skipped.
    """
    parts = []
    for relative in package_files(root, package):
        content = pathlib.Path(root, relative).read_bytes()
        if not _is_text(content):
            continue
        parts.append(f"# file: {relative}\n".encode())
        parts.append(content if content.endswith(b"\n") or not content else content + b"\n")
    return b"".join(parts)


def _versions_fingerprint(roots: Sequence[tuple[str, str]]) -> str:
    """12 hex digits over the sorted `name-version.dist-info` directory names of the roots."""
    installed = sorted(
        f"{label}/{entry.name}"
        for label, root in roots
        for entry in os.scandir(root)
        if entry.name.endswith((".dist-info", ".egg-info"))
    )
    return hashlib.sha256("\n".join(installed).encode()).hexdigest()[:12]


def build_repository_corpus(roots: Sequence[tuple[str, str]]) -> Corpus:
    """The repository corpus of (label, directory) roots: document "<label>/<package>" per tree.

    Named "repositories-<python version>-<fingerprint of the installed distributions' names and
    versions>"; its sha256 (over names and bytes) is the same on every machine with the same
    installation. Raises ValueError for a root that is not a directory or a repeated label.
    """
    labels = [label for label, _ in roots]
    if len(set(labels)) != len(labels):
        raise ValueError(f"roots must have distinct labels, got {labels}")
    for label, root in roots:
        if not os.path.isdir(root):
            raise ValueError(f"root {label!r} is {root!r}, which is not a directory; pass one")
    documents = [
        (f"{label}/{package}", repository_document(root, package))
        for label, root in roots
        for package in package_trees(root)
    ]
    name = f"repositories-{platform.python_version()}-{_versions_fingerprint(roots)}"
    return build_corpus(name, documents)


@functools.cache
def repository_corpus() -> Corpus:
    """The repository corpus of this installation (`installed_roots`), built on first use.

    Cached: the first call reads every source file of the standard library and site-packages
    (over 100 MB of text on a machine-learning install), later calls return the same object.
    """
    return build_repository_corpus(installed_roots())


def longest_documents(corpus: Corpus, count: int = 10) -> tuple[tuple[str, int], ...]:
    """The `count` longest documents as (name, bytes), longest first, ties by name.

    A row of seq_len tokens is one document's chunk (BOS, then bytes) when the document has at
    least seq_len - 1 bytes; ask `longest_documents(corpus, 1)[0][1] >= seq_len - 1`.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    order = sorted(range(corpus.num_documents), key=lambda i: (-corpus.lengths[i], i))
    return tuple((corpus.doc_names[i], int(corpus.lengths[i])) for i in order[:count])


def _check_data_file(path: str) -> None:
    fix = "pass an existing plain-text file or a JSONL file with a 'text' field on each line"
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist (or is not a file); {fix}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"data file {path!r} is empty; {fix}")


def _jsonl_documents(path: str) -> list[tuple[str, bytes]]:
    documents = []
    with open(path, "rb") as lines:
        for line_number, raw_line in enumerate(lines, start=1):
            where = f"data file {path!r}, line {line_number}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{where} is not UTF-8 (byte {raw_line[error.start]:#04x} at column "
                    f"{error.start + 1}); JSONL files must be UTF-8: re-encode the file (e.g. "
                    "iconv -f latin1 -t utf-8)"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{where} is not valid JSON ({error.msg}); write one JSON object per line, "
                    'like {"text": "..."}'
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f"{where} has no string 'text' field; write one JSON object per line, "
                    'like {"text": "..."}'
                )
            name = f"{os.path.basename(path)}:{line_number}"
            documents.append((name, record["text"].encode("utf-8")))
    return documents


@functools.lru_cache(maxsize=4)
def _load_files(files: tuple[tuple[str, int, int], ...]) -> Corpus:
    """Corpus of (path, mtime_ns, size) keys; the stamps make the cache notice edited files."""
    documents = []
    for path, _, _ in files:
        if path.endswith(JSONL_SUFFIXES):
            file_documents = _jsonl_documents(path)
        else:
            raw = pathlib.Path(path).read_bytes()
            reason = _not_text_reason(raw)
            if reason is not None:
                warnings.warn(
                    f"data file {path!r} does not look like text ({reason}); its bytes are "
                    "trained on as they are: pass plain-text (UTF-8) or JSONL files"
                )
            file_documents = [(os.path.basename(path), raw)]
        if not any(content for _, content in file_documents):
            raise ValueError(
                f"data file {path!r} contains no text; give it at least one non-empty document"
            )
        documents += file_documents
    return build_corpus("files:" + ",".join(os.path.basename(p) for p, _, _ in files), documents)


def load_text_files(paths: Sequence[str]) -> Corpus:
    """A corpus from plain-text files (one document each) and `.jsonl` files (one per line).

    Documents are named by the file's base name (and line), so the split and the hash do not
    depend on the directory the files are read from.

    Raises ValueError naming the path (and line) for a missing or empty file, a JSONL line that is
    not UTF-8 or not JSON, or one without a string `text` field. Warns (naming the path) for a
    plain file that is not UTF-8 text, such as a binary.
    """
    if isinstance(paths, str) or not paths:
        raise ValueError(f"paths must be a non-empty sequence of file paths, got {paths!r}")
    for path in paths:
        _check_data_file(path)
    stat = [os.stat(path) for path in paths]
    keys = tuple(
        (os.path.normpath(p), s.st_mtime_ns, s.st_size) for p, s in zip(paths, stat, strict=True)
    )
    return _load_files(keys)


def load_corpus(paths: Sequence[str] = (), embedded: EmbeddedCorpus = "stdlib") -> Corpus:
    """The user's files when `paths` is non-empty, else the embedded corpus named `embedded`
    (one of `EMBEDDED_CORPORA`)."""
    if embedded not in EMBEDDED_CORPORA:
        raise ValueError(f"embedded corpus must be one of {EMBEDDED_CORPORA}, got {embedded!r}")
    if paths:
        return load_text_files(paths)
    return stdlib_corpus() if embedded == "stdlib" else repository_corpus()


def _validation_draw(doc_name: str) -> float:
    """A uniform number in [0, 1) fixed by the document name alone."""
    digest = hashlib.sha256(doc_name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


@functools.lru_cache(maxsize=8)
def split_corpus(corpus: Corpus, which: str, val_fraction: float) -> Corpus:
    """The train or validation documents of `corpus`: a document is in validation when a hash of
    its name falls below `val_fraction`. Cached per (corpus, split, fraction)."""
    if which not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {which!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}; try 0.02")
    in_validation = np.array([_validation_draw(n) < val_fraction for n in corpus.doc_names])
    chosen = np.flatnonzero(in_validation if which == "validation" else ~in_validation)
    if chosen.size == 0:
        raise ValueError(
            f"the {which} split of corpus {corpus.name!r} is empty ({corpus.num_documents} "
            f"documents, val_fraction={val_fraction}); documents are split whole, so give more "
            "of them (more files, or a JSONL file with one document per line) or change "
            "val_fraction"
        )
    documents = [(corpus.doc_names[i], corpus.document(i).tobytes()) for i in chosen]
    return build_corpus(f"{corpus.name}/{which}", documents)
