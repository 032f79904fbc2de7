"""Text interleaved with images: documents, packing, batches, and the training mix with images.

    cfg = MultimodalDataConfig(seq_len=128, batch_size=16, corpus_weight=0.2, digits_weight=1.0,
                               colour_weight=1.0)
    it = make_multimodal_iterator(cfg)   # endless, checkpointable grain iterator
    batch = next(it)                     # the text batch (`train.packing`) and the image arrays
    logits = model(batch["tokens"], batch["segment_ids"], batch_images(batch))

An image in a document is one placeholder run of the token stream (`train.tokenizer`):

    <image_start> <image> x (h / 2)(w / 2) <image_end>

with h x w its patch grid: the image keeps its native resolution unless it has more than
`image_patches` patches, when it is resized to fit that budget at its aspect ratio
(`fit_to_patch_budget`, both sides whole 2 x 2 blocks of patches). A document is BOS and its
parts in reading order (`interleaved_example`); no target inside an image run counts in the loss
(the pad tokens, the start and end markers), and an image belongs to its document: its run takes
the document's segment id, so KDA's state resets, MLA's mask and Quantile Balancing's statistics
treat it as part of that document.

grain packs documents into rows of `seq_len` tokens and, alongside, their images' patches into a
vision row of `row_patches` slots: one document's tokens and patches go into the same row, both in
the same order, and a document goes only where both fit. A batch is `train.packing`'s batch plus

    image_pixels       float32 [B, P, p p C]  patches (`models.vision.patchify`), pixels scaled
                                              to [-1, 1]; 0 in empty slots
    image_segment_ids  int32   [B, P]         1, 2, ... per image of the row; 0 in empty slots
    image_positions    int32   [B, P, 2]      each patch's (row, col) in its image's grid

vision row b holding the images of token row b in the order of their runs, so the k-th
placeholder of the batch (row-major) is the k-th merged token of the buffer
(`models.vision.merge_image_features`); `batch_images` reads them as a `models.vision.VisionBatch`.
Rows of text only have empty vision rows (the same shapes: one compiled step).

The mix (`MultimodalDataConfig`): corpus chunks (`train.data`) and image question-answer examples
(`train.image_tasks`: "<image> Which digit? 7", loss on the answer bytes), weighted in examples.
`vision_control` runs the controls of an experiment that the model looks at the image: "zeroed"
(every pixel 0) or "shuffled" (each example shows the image of another example of its task, its
placeholder run as long as that image needs), in training and evaluation alike.
"""

import dataclasses
import functools
import math
import sys
import zlib
from collections.abc import Sequence
from typing import Literal

import grain
import grain.experimental
import numpy as np
from PIL import Image

from models.config import ModelConfig
from models.vision import MERGE, MERGE_PATCHES, VisionBatch, patchify
from train.data import (EVAL_TASK_SEED, DataConfig, _derived_seed, _endless_corpus, load_corpus,
                        split_corpus, weigh_answers)
from train.image_tasks import Digits, ImageTask, RenderedNumber, ShapeColour, ShapeCount, Split
from train.packing import finalize_batch
from train.tokenizer import BOS_ID, IMAGE_END_ID, IMAGE_PAD_ID, IMAGE_START_ID

CHANNELS = 3
IMAGE_KEYS = ("image_pixels", "image_segment_ids", "image_positions")
# The example features grain packs: a document's tokens with their loss weights, and its
# images' patches with their (row, col) in the image's grid.
PACKED_FEATURES = ("tokens", "target_mask", "patches", "patch_coords")
VisionControl = Literal["none", "zeroed", "shuffled"]
# The image tasks of the mix: each name is a field of MultimodalDataConfig (the task's settings)
# and, with "_weight", its mixing weight.
IMAGE_TASKS = ("digits", "colour", "count", "reading")


def fit_to_patch_budget(image: np.ndarray, *, patch_size: int, max_patches: int) -> np.ndarray:
    """image uint8 [H, W, C] -> uint8 [h p, w p, C], h x w the patch grid of its native size,
    or of the largest size at its aspect ratio with h w <= max_patches.

    h and w are even (whole 2 x 2 blocks) and at least 2: each side is rounded to the nearest
    whole block (so an image may grow by up to a block's half), then the image is shrunk until
    it fits the budget. Resized with Pillow's bicubic filter (antialiased when it shrinks);
    returned as is when its size is already a grid of whole blocks within the budget.
    """
    if np.ndim(image) != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be uint8 [H, W, C], got {image.dtype} {np.shape(image)}")
    if not (isinstance(max_patches, int) and max_patches >= MERGE_PATCHES):
        raise ValueError(f"max_patches={max_patches!r} is invalid: expected an int of at least "
                         f"{MERGE_PATCHES} (one 2 x 2 block)")
    height, width = image.shape[:2]
    block = MERGE * patch_size
    scale = min(1.0, math.sqrt(max_patches * patch_size**2 / (height * width)))
    while True:
        rows = max(1, math.floor(height * scale / block + 0.5))
        cols = max(1, math.floor(width * scale / block + 0.5))
        if rows * cols * MERGE_PATCHES <= max_patches:
            break
        scale *= 0.97
    size = (cols * block, rows * block)  # Pillow's (width, height)
    if (width, height) == size:
        return image
    channels = image.shape[-1]
    picture = Image.fromarray(image[..., 0] if channels == 1 else image)
    resized = np.asarray(picture.resize(size, Image.Resampling.BICUBIC))
    return resized.reshape(size[1], size[0], channels)


def image_tokens(num_image_tokens: int) -> np.ndarray:
    """An image's placeholder run: <image_start>, <image> x num_image_tokens, <image_end>."""
    return np.array([IMAGE_START_ID, *[IMAGE_PAD_ID] * num_image_tokens, IMAGE_END_ID], np.int32)


def interleaved_example(parts: Sequence[bytes | str | np.ndarray], *, patch_size: int,
                        max_patches: int, weights: Sequence[float] | None = None) -> dict:
    """A document of text and images, in reading order, as an example to pack.

    parts: text (bytes or str, as UTF-8) and images (uint8 [H, W, 3]); each image is fit to
        max_patches (`fit_to_patch_budget`) and becomes one placeholder run (`image_tokens`).
    weights: per part, the loss weight of a text part's bytes as targets (default 1); an image
        part's weight must be 0 (no target inside an image run counts).
    Returns tokens int32 [n] (BOS, then the parts), target_mask float32 [n] (the weight of
    predicting each token; 0 for BOS and every token of an image run), patches float32
    [m, p p 3] (every image's patches in merge-block order, pixels scaled to [-1, 1]) and
    patch_coords int32 [m, 2] ((row, col) in its image's grid).
    """
    weights = [None] * len(parts) if weights is None else list(weights)
    if len(weights) != len(parts):
        raise ValueError(f"weights has {len(weights)} entries for {len(parts)} parts")
    tokens, target_mask = [np.array([BOS_ID], np.int32)], [np.zeros(1, np.float32)]
    patches, coords = [np.zeros((0, patch_size**2 * CHANNELS), np.float32)], [
        np.zeros((0, 2), np.int32)]
    for index, (part, weight) in enumerate(zip(parts, weights)):
        if isinstance(part, (bytes, str)):
            data = part.encode("utf-8") if isinstance(part, str) else part
            tokens.append(np.frombuffer(data, np.uint8).astype(np.int32))
            target_mask.append(np.full(len(data), 1.0 if weight is None else weight, np.float32))
            continue
        if weight:
            raise ValueError(f"weights[{index}]={weight} for an image: image runs are never "
                             "targets; give it 0 or None")
        if np.ndim(part) != 3 or np.shape(part)[-1] != CHANNELS:
            raise ValueError(f"parts[{index}] must be text or an image uint8 [H, W, {CHANNELS}], "
                             f"got {type(part).__name__} of shape {np.shape(part)}")
        fitted = fit_to_patch_budget(np.asarray(part), patch_size=patch_size,
                                     max_patches=max_patches)
        image_patches, image_coords = patchify(fitted.astype(np.float32) / 127.5 - 1.0,
                                               patch_size)
        run = image_tokens(len(image_patches) // MERGE_PATCHES)
        tokens.append(run)
        target_mask.append(np.zeros(run.size, np.float32))
        patches.append(image_patches)
        coords.append(image_coords)
    return {"tokens": np.concatenate(tokens), "target_mask": np.concatenate(target_mask),
            "patches": np.concatenate(patches), "patch_coords": np.concatenate(coords)}


def _with_no_images(patch_size: int, example: dict) -> dict:
    """A text example (`train.data`'s corpus chunks) with the (empty) image features."""
    return {**example, "patches": np.zeros((0, patch_size**2 * CHANNELS), np.float32),
            "patch_coords": np.zeros((0, 2), np.int32)}


def pack_multimodal_rows(examples: grain.IterDataset, *, seq_len: int, row_patches: int,
                         num_bins: int, seed: int, shuffle: bool = True) -> grain.IterDataset:
    """First-fit packs examples (`interleaved_example`'s features) into rows of `seq_len`
    tokens and `row_patches` patches, `num_bins` rows at a time, as `train.packing.pack_rows`
    packs text: each example's tokens and patches land in the same row, in the same order."""
    return grain.experimental.FirstFitPackIterDataset(
        examples,
        length_struct={"tokens": seq_len, "target_mask": seq_len, "patches": row_patches,
                       "patch_coords": row_patches},
        num_packing_bins=num_bins,
        seed=seed,
        shuffle_bins=shuffle,
    )


def finalize_multimodal_batch(rows: dict[str, np.ndarray], batch_size: int | None = None) -> dict:
    """The trainer's batch (module docstring) from stacked packed rows: `train.packing`'s
    `finalize_batch` and the image arrays. An image's patches start at its (0, 0), so a row's
    images are numbered by counting those starts.

    Raises ValueError when a row's placeholders and its images' merged tokens differ in number.
    """
    batch = finalize_batch(rows, batch_size)
    occupied = rows["patches_segment_ids"] > 0
    patches, coords = rows["patches"], rows["patch_coords"]
    missing = batch["tokens"].shape[0] - occupied.shape[0]
    if missing:  # finalize_batch topped the batch up with empty rows
        occupied, patches, coords = (np.pad(a, ((0, missing),) + ((0, 0),) * (a.ndim - 1))
                                     for a in (occupied, patches, coords))
    starts = occupied & (coords == 0).all(-1)
    placeholders = (batch["tokens"] == IMAGE_PAD_ID).sum(1)
    merged = occupied.sum(1) // MERGE_PATCHES
    if (placeholders != merged).any():
        row = int(np.flatnonzero(placeholders != merged)[0])
        raise ValueError(f"row {row} has {placeholders[row]} image placeholders but its images "
                         f"have {merged[row]} merged tokens: each image needs one run of "
                         "(h/2)(w/2) <image> tokens (interleaved_example)")
    return {
        **batch,
        "image_pixels": np.where(occupied[..., None], patches, 0.0).astype(np.float32),
        "image_segment_ids": (np.cumsum(starts, axis=1) * occupied).astype(np.int32),
        "image_positions": np.where(occupied[..., None], coords, 0).astype(np.int32),
    }


def batch_images(batch: dict) -> VisionBatch | None:
    """The batch's vision buffer (`models.vision.VisionBatch`), None for a batch of text only
    (no image arrays)."""
    present = [key in batch for key in IMAGE_KEYS]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"a batch with images needs all of {IMAGE_KEYS}, got "
                         f"{[key for key in IMAGE_KEYS if key in batch]}")
    return VisionBatch(*(batch[key] for key in IMAGE_KEYS))


@dataclasses.dataclass(frozen=True)
class MultimodalDataConfig(DataConfig):
    """`train.data.DataConfig`'s corpus mixed with image question-answer tasks.

    patch_size: p, pixels per patch side: the model's `vision.patch_size`.
    image_patches: the patch budget of one image (`fit_to_patch_budget`), a multiple of 4.
    row_patches: P, patch slots of a vision row (the images packed with one token row).
    digits_weight, colour_weight, count_weight, reading_weight: mixing weights of the image
        tasks, in examples, next to corpus_weight (a corpus chunk fills a row; an image example
        of tens of tokens shares a row with others). The synthetic text tasks (mqar_weight, ...)
        are not part of this mix.
    digits, colour, count, reading: the tasks' settings (`train.image_tasks`).
    answer_weight (DataConfig's): the loss weight of each answer byte of an image task in
        training, against 1 for a corpus byte. Evaluation counts answers alike.
    vision_control: "none"; or a control: "zeroed" or "shuffled" images (module docstring).
    """

    patch_size: int = 4
    image_patches: int = 64
    row_patches: int = 256
    digits_weight: float = 0.0
    colour_weight: float = 0.0
    count_weight: float = 0.0
    reading_weight: float = 0.0
    digits: Digits = dataclasses.field(default_factory=Digits)
    colour: ShapeColour = dataclasses.field(default_factory=ShapeColour)
    count: ShapeCount = dataclasses.field(default_factory=ShapeCount)
    reading: RenderedNumber = dataclasses.field(default_factory=RenderedNumber)
    vision_control: VisionControl = "none"

    def __post_init__(self):
        super().__post_init__()
        for name in ("mqar_weight", "needle_weight", "multihop_weight"):
            if getattr(self, name):
                raise ValueError(f"MultimodalDataConfig.{name}={getattr(self, name)}: the "
                                 "synthetic text tasks are not part of the image mix; set it to 0")
        for name, low in (("patch_size", 1), ("image_patches", MERGE_PATCHES),
                          ("row_patches", MERGE_PATCHES)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (
                    name != "patch_size" and value % MERGE_PATCHES):
                expected = "a positive int" if name == "patch_size" else (
                    f"a multiple of {MERGE_PATCHES} (whole 2 x 2 blocks), at least {low}")
                raise ValueError(f"MultimodalDataConfig.{name}={value!r} is invalid: expected "
                                 f"{expected}")
        if self.row_patches < self.image_patches:
            raise ValueError(f"MultimodalDataConfig.row_patches={self.row_patches} is below "
                             f"image_patches={self.image_patches}: a vision row must hold an "
                             "image of the full budget")
        if self.vision_control not in ("none", "zeroed", "shuffled"):
            raise ValueError(f"MultimodalDataConfig.vision_control must be 'none', 'zeroed' or "
                             f"'shuffled', got {self.vision_control!r}")

    def source_weights(self) -> dict[str, float]:
        return {**super().source_weights(),
                **{name: getattr(self, f"{name}_weight") for name in IMAGE_TASKS}}

    def image_tasks(self) -> dict[str, ImageTask]:
        """The image tasks by name (IMAGE_TASKS), whatever their weights."""
        return {name: getattr(self, name) for name in IMAGE_TASKS}


def check_model_fits(model: ModelConfig, data: DataConfig) -> None:
    """Raises ValueError unless a model of `model` can train on `data`'s batches: for a
    MultimodalDataConfig, a vision tower of the data's patch size and 3 channels whose image
    token is the placeholder <image>. Text data fits any model."""
    if not isinstance(data, MultimodalDataConfig):
        return
    vision = model.vision
    if vision is None:
        raise ValueError("the data has images (MultimodalDataConfig) but the model has no vision "
                         "tower: set model.vision=VisionConfig(..., image_token_id="
                         f"train.tokenizer.IMAGE_PAD_ID={IMAGE_PAD_ID})")
    for name, have, want in (("patch_size", vision.patch_size, data.patch_size),
                             ("in_channels", vision.in_channels, CHANNELS),
                             ("image_token_id", vision.image_token_id, IMAGE_PAD_ID)):
        if have != want:
            raise ValueError(f"model.vision.{name}={have} does not fit the data: expected {want} "
                             f"(data.patch_size, RGB images, train.tokenizer.IMAGE_PAD_ID)")


def _shuffled_partner(split: Split, index: int, seed: int, size: int) -> int:
    """The example whose image example `index` shows under vision_control="shuffled": another
    random example in training; in the held-out split (of `size` examples) the next one in a
    seeded cyclic order, so every held-out image is shown once and never with its own text."""
    if split == "train":
        return int(np.random.default_rng([seed, zlib.crc32(b"shuffled"), index]).integers(2**62))
    order = _held_out_order(seed, size)
    position = np.empty(size, np.int64)
    position[order] = np.arange(size)
    return int(order[(position[index] + 1) % size])


@functools.cache
def _held_out_order(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, zlib.crc32(b"shuffled")]).permutation(size)


def _task_example(cfg: MultimodalDataConfig, name: str, split: Split, seed: int,
                  index: int) -> dict:
    """Example `index` of image task `name` in `split`: BOS, the image's run, the question, the
    answer (the only targets, of weight 1), under cfg.vision_control."""
    task = cfg.image_tasks()[name]
    qa = task.example(split, index, seed)
    image = qa.image
    if cfg.vision_control == "shuffled":
        partner = _shuffled_partner(split, index, seed, task.held_out_size())
        image = task.example(split, partner, seed).image
    example = interleaved_example([image, qa.question, qa.answer], patch_size=cfg.patch_size,
                                  max_patches=cfg.image_patches, weights=[0, 0, 1])
    if cfg.vision_control == "zeroed":
        example["patches"] = np.zeros_like(example["patches"])
    if example["tokens"].size > cfg.seq_len:
        raise ValueError(f"an example of image task {name!r} has {example['tokens'].size} "
                         f"tokens, more than seq_len={cfg.seq_len}; raise seq_len or lower "
                         "image_patches")
    return example


def image_task_examples(cfg: MultimodalDataConfig, name: str, split: Split,
                        seed: int) -> grain.MapDataset:
    """Image task `name`'s examples (`_task_example`) as a random-access grain dataset:
    endless in training, their answers weighing cfg.answer_weight as a synthetic task's do
    (`train.data.weigh_answers`); the held-out split's examples in order, answers of weight 1."""
    size = sys.maxsize if split == "train" else cfg.image_tasks()[name].held_out_size()
    examples = grain.MapDataset.range(size).map(
        functools.partial(_task_example, cfg, name, split, seed))
    if split != "train":
        return examples
    return examples.map(functools.partial(weigh_answers, cfg.answer_weight))


def _read_options(cfg: DataConfig) -> grain.ReadOptions:
    # Drawing and resizing an image takes about a millisecond: two threads keep ahead of a step.
    return grain.ReadOptions(num_threads=2, prefetch_buffer_size=2 * cfg.batch_size)


def make_multimodal_dataset(cfg: MultimodalDataConfig) -> grain.IterDataset:
    """The endless training stream of batches: corpus chunks and image-task examples mixed by
    weight (cfg.source_weights), packed into rows with their images, and batched."""
    sources, weights = [], []
    for name, weight in cfg.source_weights().items():
        if weight == 0.0:
            continue
        if name == "corpus":
            corpus = split_corpus(load_corpus(cfg.paths, cfg.corpus), "train", cfg.val_fraction)
            source = _endless_corpus(cfg, corpus).map(
                functools.partial(_with_no_images, cfg.patch_size))
        else:
            source = image_task_examples(cfg, name, "train", _derived_seed(cfg.seed, name))
        sources.append(source)
        weights.append(weight)
    mixed = sources[0] if len(sources) == 1 else grain.MapDataset.mix(sources, weights)
    rows = pack_multimodal_rows(mixed.to_iter_dataset(_read_options(cfg)), seq_len=cfg.seq_len,
                                row_patches=cfg.row_patches, num_bins=cfg.packing_bins,
                                seed=_derived_seed(cfg.seed, "packing"))
    return rows.batch(cfg.batch_size, drop_remainder=True).map(finalize_multimodal_batch)


def make_multimodal_iterator(cfg: MultimodalDataConfig) -> grain.DatasetIterator:
    """An endless iterator of training batches with images; it checkpoints and resumes as
    `train.data.make_train_iterator`'s does (`get_state` / `set_state`, grain.checkpoint)."""
    return iter(make_multimodal_dataset(cfg))


def _alone_in_a_row(cfg: MultimodalDataConfig, example: dict) -> dict:
    """One example as a packed row of seq_len tokens and row_patches patches (grain's layout)."""
    row = {}
    for feature, length in (("tokens", cfg.seq_len), ("target_mask", cfg.seq_len),
                            ("patches", cfg.row_patches), ("patch_coords", cfg.row_patches)):
        value = example[feature]
        row[feature] = np.pad(value, ((0, length - len(value)),) + ((0, 0),) * (value.ndim - 1))
        row[f"{feature}_segment_ids"] = (np.arange(length) < len(value)).astype(np.int32)
        row[f"{feature}_positions"] = np.where(np.arange(length) < len(value),
                                               np.arange(length), 0).astype(np.int32)
    return row


def make_image_task_batches(cfg: MultimodalDataConfig, name: str, *,
                            seed: int = EVAL_TASK_SEED) -> grain.MapDataset:
    """Image task `name`'s held-out split as batches of cfg's shape, one example per row (the
    last batch topped up with empty rows), under cfg.vision_control, for answer accuracy
    (`train.synthetic.answer_accuracy`). Random access: `batches[i]`."""
    examples = image_task_examples(cfg, name, "held_out", seed)
    rows = examples.map(functools.partial(_alone_in_a_row, cfg))
    return rows.batch(cfg.batch_size).map(
        functools.partial(finalize_multimodal_batch, batch_size=cfg.batch_size))
