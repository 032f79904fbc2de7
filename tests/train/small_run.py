"""A two-layer training run of the real trainer in two stages, for checkpoint and resume tests
(imported by the tests and by the child process they kill during a save)."""

import dataclasses
import json
import os

from train.cli import apply_overrides
from train.loop import Stage, TrainConfig

# Two layers (KDA with a dense FFN, Gated MLA with MoE): every kind of state, quick to compile.
SMALL_RUN = [
    "model.num_layers=2", "model.kda_layers=1", "model.full_attn_layers=2",
    "data.packing_bins=4", "steps=2", "log_every=1", "checkpoint_every=1", "eval_batches=1",
    "fast_compile=true", "progress=false", "mesh.data=1",
]
# Two stages of one step each: checkpoint 1 closes the first, so resuming from it starts the
# second stage's data. Both have the shape of the other tests' runs, so that one compiled step
# (and one in the persistent compilation cache) serves them all; the second draws other batches
# (`small_run` gives each stage its own data seed).
STAGES = [(32, 2, 1), (32, 2, 1)]  # (seq_len, batch_size, steps)


def small_run(overrides: list[str], stages: list[tuple[int, int, int]]):
    """(TrainConfig with `overrides`, its Stages from (seq_len, batch_size, steps) triples).
    Stage i draws its data with seed `data.seed + i`: consecutive stages never repeat batches,
    even at the same shape."""
    config = apply_overrides(TrainConfig(), overrides)
    return config, [
        Stage(dataclasses.replace(config.data, seq_len=length, batch_size=rows,
                                  seed=config.data.seed + index), steps)
        for index, (length, rows, steps) in enumerate(stages)
    ]


def write_corpus(folder) -> list[str]:
    """Two small data files in `folder`, for runs whose data a test can rewrite: docs.jsonl (300
    short documents, so both splits have some) and notes.txt (one document). Returns their paths."""
    docs = os.path.join(folder, "docs.jsonl")
    with open(docs, "w") as f:
        for number in range(300):
            words = (f"word{(number * 7 + k) % 97}" for k in range(40))
            text = f"document {number}: " + " ".join(words)
            f.write(json.dumps({"text": text}) + "\n")
    notes = os.path.join(folder, "notes.txt")
    with open(notes, "w") as f:
        f.write("notes on the run: " * 50 + "\n")
    return [docs, notes]
