"""Packing variable-length examples into fixed-length rows, and the batch format the trainer reads.

Examples are dicts `tokens: int32 [n]`, `target_mask: float32 [n]` with n <= seq_len (documents are
cut to that length before packing). grain's first-fit packer places them into rows of exactly
`seq_len` slots; slots it leaves empty hold 0 and segment id 0. `finalize_batch` then builds the
batch every trainer step and evaluation consumes, all arrays [B, T]:

    tokens       int32    model input; PAD_ID in empty slots
    targets      int32    next token of the same segment; PAD_ID where there is none
    loss_mask    float32  weight of `targets` in the loss: 1 for a target of its segment that
                          is not padding (a task answer's may be DataConfig.answer_weight), else 0
    segment_ids  int32    1, 2, ... per packed example in a row; 0 in empty slots
    positions    int32    position inside the segment, restarting at 0

so that `loss = sum(cross_entropy(model(tokens), targets) * loss_mask) / sum(loss_mask)`; no
prediction ever crosses a segment boundary, and `segment_ids` is what resets the KDA state and
masks attention between documents.
"""

import grain
import grain.experimental
import numpy as np

from train.tokenizer import PAD_ID

PACKED_FEATURES = ("tokens", "target_mask")


def pack_rows(
    examples: grain.IterDataset, *, seq_len: int, num_bins: int, seed: int, shuffle: bool = True
) -> grain.IterDataset:
    """First-fit packs examples into rows of `seq_len` slots, `num_bins` rows at a time.

    More bins leave less padding. With `shuffle` the rows of each group are emitted in an order
    drawn from `seed`. The result is a checkpointable grain dataset of packed rows (grain's
    feature layout: `tokens`, `target_mask`, `tokens_segment_ids`, `tokens_positions`, ...).
    """
    return grain.experimental.FirstFitPackIterDataset(
        examples,
        length_struct={feature: seq_len for feature in PACKED_FEATURES},
        num_packing_bins=num_bins,
        seed=seed,
        shuffle_bins=shuffle,
    )


def single_segment_row(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A full-length example as a packed row of one segment (grain's feature layout)."""
    length = example["tokens"].shape[-1]
    return {
        **example,
        "tokens_segment_ids": np.ones(length, np.int32),
        "tokens_positions": np.arange(length, dtype=np.int32),
    }


def finalize_batch(rows: dict[str, np.ndarray], batch_size: int | None = None) -> dict:
    """The trainer's batch (see the module docstring) from stacked packed rows [B, T].

    batch_size: when given, a short final batch is topped up with empty rows to this many, so
        every batch has one shape and a jitted step compiles once.
    """
    segment_ids = rows["tokens_segment_ids"].astype(np.int32)
    tokens, target_mask = rows["tokens"], rows["target_mask"]
    positions = rows["tokens_positions"]
    if batch_size is not None:
        missing = batch_size - segment_ids.shape[0]
        if missing < 0:
            raise ValueError(
                f"batch of {segment_ids.shape[0]} rows exceeds batch_size={batch_size}"
            )
        widths = ((0, missing), (0, 0))
        segment_ids, tokens, target_mask, positions = (
            np.pad(a, widths) for a in (segment_ids, tokens, target_mask, positions)
        )
    occupied = segment_ids > 0
    next_in_segment = occupied[:, 1:] & (segment_ids[:, 1:] == segment_ids[:, :-1])
    targets = np.full(tokens.shape, PAD_ID, np.int32)
    targets[:, :-1] = np.where(next_in_segment, tokens[:, 1:], PAD_ID)
    loss_mask = np.zeros(tokens.shape, np.float32)
    loss_mask[:, :-1] = np.where(next_in_segment, target_mask[:, 1:], 0.0)
    return {
        "tokens": np.where(occupied, tokens, PAD_ID).astype(np.int32),
        "targets": targets,
        "loss_mask": loss_mask,
        "segment_ids": segment_ids,
        "positions": np.where(occupied, positions, 0).astype(np.int32),
    }
