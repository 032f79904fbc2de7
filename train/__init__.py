"""Training system. The data side, re-exported here:

- `train.tokenizer`: the byte-level vocabulary (ids 0..255 are bytes; PAD, BOS, SEP above;
  VOCAB_SIZE = 264).
- `train.corpus`: the embedded standard-library corpus and user text/JSONL files, split into
  train and validation by document, hashed, with their order-0 entropy.
- `train.synthetic`: MQAR, needle-in-a-haystack and multi-hop lookup tasks from a seed.
- `train.packing`: packing into fixed-length rows with segment ids, and the batch format.
- `train.data`: `DataConfig` and the grain pipelines (`make_train_iterator`,
  `make_eval_iterator`, `make_task_batches`).
"""

from train.corpus import Corpus, load_corpus, load_text_files, split_corpus, stdlib_corpus
from train.data import (
    EVAL_TASK_SEED,
    DataConfig,
    bits_per_byte,
    data_manifest,
    make_eval_dataset,
    make_eval_iterator,
    make_task_batches,
    make_train_dataset,
    make_train_iterator,
)
from train.packing import finalize_batch, pack_rows
from train.synthetic import MQAR, MultiHop, NeedleInHaystack, answer_accuracy, task_dataset
from train.tokenizer import BOS_ID, PAD_ID, SEP_ID, VOCAB_SIZE, decode, encode

__all__ = [
    "BOS_ID",
    "EVAL_TASK_SEED",
    "MQAR",
    "PAD_ID",
    "SEP_ID",
    "VOCAB_SIZE",
    "Corpus",
    "DataConfig",
    "MultiHop",
    "NeedleInHaystack",
    "answer_accuracy",
    "bits_per_byte",
    "data_manifest",
    "decode",
    "encode",
    "finalize_batch",
    "load_corpus",
    "load_text_files",
    "make_eval_dataset",
    "make_eval_iterator",
    "make_task_batches",
    "make_train_dataset",
    "make_train_iterator",
    "pack_rows",
    "split_corpus",
    "stdlib_corpus",
    "task_dataset",
]
