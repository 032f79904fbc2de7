"""grain input pipelines: the training mix, the validation corpus and synthetic-task evaluation.

    cfg = DataConfig(seq_len=256, batch_size=16)
    it = make_train_iterator(cfg)          # endless, checkpointable grain iterator
    batch = next(it)                       # tokens, targets, loss_mask, segment_ids, positions
    for batch in make_eval_iterator(cfg, max_batches=8): ...   # validation, in a fixed order

Batches are dicts of numpy arrays [batch_size, seq_len] described in `train.packing`. Save the
training iterator with `grain.checkpoint.CheckpointSave(it)` inside an orbax `Composite` (and
restore with `CheckpointRestore`), or with `it.get_state()` / `it.set_state(state)`: the restored
iterator yields exactly the batches the original would have.

Corpus documents are cut into chunks of `seq_len` tokens that overlap by one, so every byte is a
prediction target exactly once: the first chunk of a document starts with BOS_ID, each later one
with the last byte of the previous chunk as context. Chunks are shuffled by seed (a new order each
epoch), mixed with synthetic-task examples by weight, and packed into rows.
"""

import dataclasses
import functools
import hashlib
import math
import os
import sys
import zlib

import grain
import grain.experimental
import numpy as np

from train.corpus import EMBEDDED_CORPORA, Corpus, EmbeddedCorpus, load_corpus, split_corpus
from train.packing import finalize_batch, pack_rows, single_segment_row
from train.synthetic import MQAR, MultiHop, NeedleInHaystack, Task, task_dataset
from train.tokenizer import BOS_ID

# Synthetic training streams use 32-bit derived seeds, so evaluation seeds from 2**32 upward can
# never draw the same examples as any training run.
EVAL_TASK_SEED = 2**32
# Validation order is fixed, independent of the training seed, so runs are compared on the same
# batches even when only the first few are evaluated.
_EVAL_ORDER_SEED = 0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What the model trains and evaluates on.

    seq_len, batch_size: every batch is [batch_size, seq_len].
    seed: drives the chunk order, the packing order and the synthetic examples.
    corpus: the embedded corpus when `paths` is empty: "stdlib" (one document per module) or
        "repositories" (one document per installed package tree, up to tens of MB: for rows of
        64K to 1M tokens); see `train.corpus`.
    paths: plain-text or `.jsonl` files to train on instead of the embedded corpus.
    val_fraction: share of documents (chosen by a hash of their name) held out for validation.
    long_document_bias: share of corpus chunks drawn only from chunks that fill a whole row
        (documents longer than seq_len); 0 samples all chunks alike, 1 only long-document ones.
    corpus_weight, mqar_weight, needle_weight, multihop_weight: mixing weights of the sources,
        counted in examples (a synthetic example fills one row; a corpus chunk at most one).
    mqar, needle, multihop: the synthetic tasks' settings; in training each example is seq_len
        tokens long.
    answer_weight: loss weight of each answer token of a task in training (a synthetic task's
        here, an image task's in train.multimodal), against 1 for a corpus byte (the loss is the
        mean over loss_mask as weights). A task row has a few answers where a corpus chunk has
        seq_len - 1 targets, so at 1 the corpus drowns the tasks' gradient. Evaluation is
        unweighted.
    packing_bins: rows packed together at a time; more bins leave less padding.
    shards: independent packing streams the training batch is drawn from, batch_size / shards
        rows each: the mixed example stream is dealt round-robin to the shards, each packs its
        own rows, and a batch is shard 0's rows, then shard 1's, ... A run of P processes loads
        only shards/P of them in each process (`make_train_dataset`), so P must divide shards;
        the batches depend on shards, never on the process count.
    """

    seq_len: int = 256
    batch_size: int = 16
    seed: int = 0
    corpus: EmbeddedCorpus = "stdlib"
    paths: tuple[str, ...] = ()
    val_fraction: float = 0.02
    long_document_bias: float = 0.0
    corpus_weight: float = 1.0
    mqar_weight: float = 0.0
    needle_weight: float = 0.0
    multihop_weight: float = 0.0
    mqar: MQAR = dataclasses.field(default_factory=MQAR)
    needle: NeedleInHaystack = dataclasses.field(default_factory=NeedleInHaystack)
    multihop: MultiHop = dataclasses.field(default_factory=MultiHop)
    answer_weight: float = 1.0
    packing_bins: int = 32
    shards: int = 1

    def __post_init__(self):
        for name, low in (
            ("seq_len", 2), ("batch_size", 1), ("packing_bins", 1), ("seed", 0), ("shards", 1)
        ):
            if getattr(self, name) < low:
                raise ValueError(
                    f"DataConfig.{name} must be at least {low}, got {getattr(self, name)}"
                )
        if isinstance(self.paths, str):
            raise ValueError(
                "DataConfig.paths must be a sequence of file paths, got the string "
                f"{self.paths!r}; write paths=({self.paths!r},)"
            )
        object.__setattr__(self, "paths", tuple(self.paths))
        if self.batch_size % self.shards:
            raise ValueError(
                f"DataConfig.batch_size={self.batch_size} must be a multiple of "
                f"shards={self.shards} (each shard packs batch_size / shards rows of a batch)"
            )
        if self.corpus not in EMBEDDED_CORPORA:
            raise ValueError(
                f"DataConfig.corpus must be one of {EMBEDDED_CORPORA}, got {self.corpus!r}"
            )
        if self.paths and self.corpus != "stdlib":
            raise ValueError(
                f"DataConfig.paths={self.paths} replace the embedded corpus, so "
                f"corpus={self.corpus!r} would be ignored; give paths or corpus, not both"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"DataConfig.val_fraction must lie in (0, 1), got {self.val_fraction}")
        if not 0.0 <= self.long_document_bias <= 1.0:
            raise ValueError(
                f"DataConfig.long_document_bias must lie in [0, 1], got {self.long_document_bias}"
            )
        if not (math.isfinite(self.answer_weight) and self.answer_weight > 0):
            raise ValueError(
                f"DataConfig.answer_weight must be finite and positive, got {self.answer_weight}"
            )
        weights = self.source_weights()
        if not all(math.isfinite(w) and w >= 0 for w in weights.values()) or not any(
            weights.values()
        ):
            raise ValueError(
                f"DataConfig mixing weights must be finite, non-negative and not all zero, got "
                f"{weights}; for plain language modelling set corpus_weight=1"
            )

    def source_weights(self) -> dict[str, float]:
        return {
            "corpus": self.corpus_weight,
            "mqar": self.mqar_weight,
            "needle": self.needle_weight,
            "multihop": self.multihop_weight,
        }

    def tasks(self) -> dict[str, Task]:
        return {"mqar": self.mqar, "needle": self.needle, "multihop": self.multihop}


def _derived_seed(seed: int, purpose: str) -> int:
    """An independent 32-bit seed (grain's shuffles take 32 bits) for one use of the run seed."""
    return int(np.random.SeedSequence([seed, zlib.crc32(purpose.encode())]).generate_state(1)[0])


def chunk_table(corpus: Corpus, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each chunk of each document starts, for chunks of `seq_len` tokens overlapping by one.

    A document of n bytes is the token stream [BOS_ID, byte_0, ..., byte_{n-1}], cut at stride
    seq_len - 1 into ceil(n / (seq_len - 1)) chunks. Returns (document index, start in the stream),
    both int64 [num_chunks].
    """
    stride = seq_len - 1
    counts = -(-corpus.lengths // stride)
    documents = np.repeat(np.arange(corpus.num_documents), counts)
    first_chunk = np.repeat(np.cumsum(counts) - counts, counts)
    starts = (np.arange(documents.size) - first_chunk) * stride
    return documents, starts


def _chunk_lengths(corpus: Corpus, seq_len: int) -> np.ndarray:
    documents, starts = chunk_table(corpus, seq_len)
    return np.minimum(seq_len, corpus.lengths[documents] + 1 - starts)


def _chunk_example(corpus: Corpus, seq_len: int, table, chunk: int) -> dict[str, np.ndarray]:
    documents, starts = table
    document, start = corpus.document(documents[chunk]), int(starts[chunk])
    # Stream position p > 0 holds byte p - 1; position 0 is BOS_ID.
    end = min(start + seq_len, document.size + 1)
    body = document[max(start - 1, 0) : end - 1].astype(np.int32)
    tokens = np.concatenate([np.array([BOS_ID], np.int32), body]) if start == 0 else body
    target_mask = np.ones(tokens.size, np.float32)
    # The first token is context only: BOS, or the byte the previous chunk already predicts.
    target_mask[0] = 0.0
    return {"tokens": tokens, "target_mask": target_mask}


def chunk_examples(corpus: Corpus, seq_len: int):
    """The function chunk index -> example ({tokens, target_mask}) for `corpus` (`chunk_table`)."""
    return functools.partial(_chunk_example, corpus, seq_len, chunk_table(corpus, seq_len))


def _endless_corpus(cfg: DataConfig, corpus: Corpus) -> grain.MapDataset:
    """Corpus chunks in a new seeded order each epoch, biased toward long documents on request."""
    lengths = _chunk_lengths(corpus, cfg.seq_len)
    pools = {
        "all": (1.0 - cfg.long_document_bias, np.arange(lengths.size)),
        "long": (cfg.long_document_bias, np.flatnonzero(lengths == cfg.seq_len)),
    }
    parts, weights = [], []
    for name, (weight, chunk_ids) in pools.items():
        if weight == 0.0:
            continue
        if chunk_ids.size == 0:
            raise ValueError(
                f"long_document_bias={cfg.long_document_bias} but no document of "
                f"{corpus.name!r} is longer than seq_len={cfg.seq_len} bytes; lower "
                "long_document_bias or seq_len, or add longer documents (corpus='repositories' "
                "has documents of up to tens of MB)"
            )
        seed = _derived_seed(cfg.seed, f"corpus-{name}")
        shuffled = grain.MapDataset.source(chunk_ids).shuffle(seed).repeat()
        parts.append(shuffled.map(chunk_examples(corpus, cfg.seq_len)))
        weights.append(weight)
    return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)


def weigh_answers(weight: float, example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A task example for training, its answer tokens weighing `weight` in the loss
    (target_mask [L] scaled; DataConfig.answer_weight)."""
    return {**example, "target_mask": example["target_mask"] * np.float32(weight)}


def _read_options(cfg: DataConfig) -> grain.ReadOptions:
    # Making an example is a slice or a small numpy draw: two threads keep a few rows ahead of
    # the packer without crowding a small CPU.
    return grain.ReadOptions(num_threads=2, prefetch_buffer_size=2 * cfg.batch_size)


def _mixed_examples(cfg: DataConfig) -> grain.MapDataset:
    """The endless training examples: corpus chunks and task examples mixed by weight."""
    sources, weights = [], []
    for name, weight in cfg.source_weights().items():
        if weight == 0.0:
            continue
        if name == "corpus":
            corpus = split_corpus(load_corpus(cfg.paths, cfg.corpus), "train", cfg.val_fraction)
            sources.append(_endless_corpus(cfg, corpus))
        else:
            seed = _derived_seed(cfg.seed, name)
            task = cfg.tasks()[name]
            examples = task_dataset(task, length=cfg.seq_len, seed=seed, num_examples=sys.maxsize)
            sources.append(examples.map(functools.partial(weigh_answers, cfg.answer_weight)))
        weights.append(weight)
    return sources[0] if len(sources) == 1 else grain.MapDataset.mix(sources, weights)


def _concatenate_rows(parts: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
    """Stacked packed rows of several shards, [R_i, T] each, as one [sum R_i, T] in order."""
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def make_train_dataset(
    cfg: DataConfig, *, process_index: int = 0, process_count: int = 1
) -> grain.IterDataset:
    """The endless training stream of batches: examples mixed by weight, packed into rows and
    batched, split into `cfg.shards` shards (see DataConfig.shards).

    process_index, process_count: this process's share of a multi-process run (from
    jax.process_index() and jax.process_count()): batches of the contiguous rows
    [process_index * R, (process_index + 1) * R) of each global batch, R = batch_size /
    process_count, from its own shards only. Concatenating the processes' batches in process
    order gives exactly the batch of process_count=1. The iterator state is the process's own.
    """
    if process_count < 1 or cfg.shards % process_count:
        raise ValueError(
            f"process_count={process_count} must divide DataConfig.shards={cfg.shards} (each "
            f"process loads shards / process_count of them); set data.shards to a multiple of "
            "the process count"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index={process_index} must lie in [0, process_count={process_count})"
        )
    mixed = _mixed_examples(cfg)
    own = _own_shards(cfg, process_index, process_count)
    shards = [
        pack_rows(
            mixed[shard :: cfg.shards].to_iter_dataset(_read_options(cfg)),
            seq_len=cfg.seq_len,
            num_bins=cfg.packing_bins,
            seed=_derived_seed(cfg.seed, "packing"),
        ).batch(cfg.batch_size // cfg.shards, drop_remainder=True)
        for shard in range(own.start, own.stop)
    ]
    # One shard keeps its own iterator state (no zip around it), as checkpoints of unsharded
    # runs hold it.
    rows = (
        shards[0]
        if len(shards) == 1
        else grain.experimental.ZipIterDataset(shards).map(_concatenate_rows)
    )
    return rows.map(finalize_batch)


def make_train_iterator(
    cfg: DataConfig, *, process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
    """An endless iterator of training batches (this process's rows of them, see
    `make_train_dataset`); checkpoint it with grain.checkpoint (see above)."""
    return iter(make_train_dataset(cfg, process_index=process_index, process_count=process_count))


def _own_shards(cfg: DataConfig, process_index: int, process_count: int) -> slice:
    per_process = cfg.shards // process_count
    return slice(process_index * per_process, (process_index + 1) * per_process)


def global_data_state(cfg: DataConfig, process_states: list) -> dict:
    """The state of the one-process training iterator of `cfg` from the states of every
    process's share (`make_train_iterator(cfg, process_index=p, process_count=len(...))`, in
    process order): the run's data position, whatever its process count."""
    per_process = cfg.shards // len(process_states)
    shard_states = [
        shard
        for state in process_states
        for shard in ([state] if per_process == 1 else state["parents"])
    ]
    return shard_states[0] if cfg.shards == 1 else {"parents": shard_states}


def process_data_state(
    cfg: DataConfig, global_state: dict, *, process_index: int, process_count: int
) -> dict:
    """The state of process `process_index`'s share of the training iterator at the run's
    position `global_state` (`global_data_state`), for any process count that divides
    cfg.shards."""
    shard_states = [global_state] if cfg.shards == 1 else global_state["parents"]
    own = shard_states[_own_shards(cfg, process_index, process_count)]
    return own[0] if len(own) == 1 else {"parents": own}


def make_eval_dataset(cfg: DataConfig, *, max_batches: int | None = None) -> grain.IterDataset:
    """One pass over the validation documents in a fixed order, as batches of cfg's shape.

    Every validation byte is a target exactly once over the full pass; `max_batches` stops early
    (the fixed shuffle makes the first batches a sample of many files). The last batch is topped
    up with empty rows.
    """
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be at least 1 or None, got {max_batches}")
    corpus = split_corpus(load_corpus(cfg.paths, cfg.corpus), "validation", cfg.val_fraction)
    num_chunks = chunk_table(corpus, cfg.seq_len)[0].size
    order = grain.MapDataset.range(num_chunks).shuffle(_EVAL_ORDER_SEED)
    chunks = order.map(chunk_examples(corpus, cfg.seq_len))
    rows = pack_rows(
        chunks.to_iter_dataset(_read_options(cfg)),
        seq_len=cfg.seq_len,
        num_bins=cfg.packing_bins,
        seed=_EVAL_ORDER_SEED,
        shuffle=False,
    )
    batches = rows.batch(cfg.batch_size).map(
        functools.partial(finalize_batch, batch_size=cfg.batch_size)
    )
    return (
        batches
        if max_batches is None
        else grain.experimental.LimitIterDataset(batches, max_batches)
    )


def make_eval_iterator(cfg: DataConfig, *, max_batches: int | None = None) -> grain.DatasetIterator:
    """A fresh iterator over the validation batches (see `make_eval_dataset`)."""
    return iter(make_eval_dataset(cfg, max_batches=max_batches))


def make_task_batches(
    task: Task, *, seq_len: int, batch_size: int, num_batches: int, seed: int = EVAL_TASK_SEED
) -> grain.MapDataset:
    """`num_batches` batches of unpacked task examples, one example of `seq_len` tokens per row,
    for answer accuracy (`train.synthetic.answer_accuracy`). Random access: `batches[i]`."""
    examples = task_dataset(task, length=seq_len, seed=seed, num_examples=batch_size * num_batches)
    return examples.map(single_segment_row).batch(batch_size).map(finalize_batch)


def bits_per_byte(nll_nats: float, num_targets: float) -> float:
    """Bits per byte from a summed next-byte negative log-likelihood (in nats) over
    `num_targets` byte targets (the summed loss_mask of corpus batches)."""
    if num_targets <= 0:
        raise ValueError(f"num_targets must be positive, got {num_targets}")
    return float(nll_nats / (num_targets * math.log(2.0)))


@functools.lru_cache(maxsize=64)
def _sha256_of_file(path: str, mtime_ns: int, size: int) -> str:
    """sha256 of the file at `path`; the (mtime, size) stamp makes the cache notice edits."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str) -> str:
    """Hex sha256 of a data file's bytes (cached until the file's mtime or size changes)."""
    stat = os.stat(path)
    return _sha256_of_file(os.path.normpath(path), stat.st_mtime_ns, stat.st_size)


def data_manifest(cfg: DataConfig) -> dict:
    """What a run trained on, for its record: corpus name and hash, split sizes, the validation
    split's order-0 entropy (the bits per byte a context-free model would get) and, for `paths`
    data, `files`: each file's sha256, keyed by its path as given (so a resumed run can say
    which file changed)."""
    corpus = load_corpus(cfg.paths, cfg.corpus)
    train = split_corpus(corpus, "train", cfg.val_fraction)
    validation = split_corpus(corpus, "validation", cfg.val_fraction)
    manifest = {
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "train_documents": train.num_documents,
        "train_bytes": train.num_bytes,
        "validation_documents": validation.num_documents,
        "validation_bytes": validation.num_bytes,
        "validation_unigram_bits_per_byte": validation.unigram_entropy_bits(),
    }
    if cfg.paths:
        manifest["files"] = {path: file_sha256(path) for path in cfg.paths}
    return manifest
