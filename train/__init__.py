"""Training system. The data side, re-exported here:

- `train.tokenizer`: the byte-level vocabulary (ids 0..255 are bytes; PAD, BOS, SEP above;
  VOCAB_SIZE = 264).
- `train.corpus`: the embedded standard-library corpus and user text/JSONL files, split into
  train and validation by document, hashed, with their order-0 entropy.
- `train.synthetic`: MQAR, needle-in-a-haystack and multi-hop lookup tasks from a seed.
- `train.packing`: packing into fixed-length rows with segment ids, and the batch format.
- `train.data`: `DataConfig` and the grain pipelines (`make_train_iterator`,
  `make_eval_iterator`, `make_task_batches`).

The training side (imported on first use, so the data modules stay light):

- `train.optim`: `OptimConfig`, `make_optimizer` (AdamW, Muon with per-head orthogonalisation),
  `learning_rate_schedule` (warmup-stable-decay, cosine).
- `train.step`: `TrainState` (model, optimizer, skipped-step count, the MoE expert weights'
  compute copies), `make_train_step` / `make_eval_step` (the jitted functional steps: QB
  router-bias update, non-finite steps skipped and counted, QK-Clip).
- `train.checkpoint`: `Checkpointer` (orbax: state, data iterator, metadata; async, atomic;
  checksums verified on restore, damaged checkpoints skipped on resume).
- `train.metrics`: JSONL rows, plots, `train_flops_per_token` for tokens/s and MFU.
- `train.loop`: `TrainConfig`, `Trainer`, `Stage`, `train` (progress bar, evaluation,
  checkpoints, exact resume).
- `train.cli`: `apply_overrides` (typed `--set key=value`), `config_from_dict` (a config back
  from its JSON) and the shared experiment options.
- `train.inference`: `load_model` (a run's trained model alone, on any mesh, in bf16).
"""

import importlib

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

_TRAINING = {
    "OptimConfig": "train.optim",
    "make_optimizer": "train.optim",
    "learning_rate_schedule": "train.optim",
    "TrainState": "train.step",
    "make_train_step": "train.step",
    "make_eval_step": "train.step",
    "Checkpointer": "train.checkpoint",
    "train_flops_per_token": "train.metrics",
    "TrainConfig": "train.loop",
    "MeshConfig": "train.loop",
    "Stage": "train.loop",
    "Trainer": "train.loop",
    "train": "train.loop",
    "apply_overrides": "train.cli",
}


def __getattr__(name: str):
    if name in _TRAINING:
        return getattr(importlib.import_module(_TRAINING[name]), name)
    raise AttributeError(f"module 'train' has no attribute {name!r}")


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
    *_TRAINING,
]
