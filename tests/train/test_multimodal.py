"""Text interleaved with images (train.multimodal): the patch budget, the placeholder runs, the
packed batches (each image's run as long as its merged tokens, in its document's segment, no
loss on it), exact resume, the controls, and the step and model on such batches."""

import dataclasses

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from sklearn.datasets import load_sample_image

from core.sharding import init_sharded, make_mesh
from models.config import preset
from models.lm import HybridLM
from models.vision import VisionConfig, patch_positions, patchify
from train.data import DataConfig
from train.image_tasks import ShapeColour
from train.loop import MeshConfig, TrainConfig, Trainer
from train.multimodal import (IMAGE_KEYS, MultimodalDataConfig, _alone_in_a_row,
                              _shuffled_partner, batch_images, check_model_fits,
                              finalize_multimodal_batch, fit_to_patch_budget,
                              image_task_examples, interleaved_example,
                              make_image_task_batches, make_multimodal_iterator)
from train.tokenizer import BOS_ID, IMAGE_END_ID, IMAGE_PAD_ID, IMAGE_START_ID, decode

PATCH = 4
RUN_TOKENS = (IMAGE_START_ID, IMAGE_PAD_ID, IMAGE_END_ID)
MIX = MultimodalDataConfig(seq_len=64, batch_size=4, seed=3, patch_size=PATCH,
                           image_patches=32, row_patches=96, corpus_weight=0.3,
                           digits_weight=1.0, colour_weight=1.0, count_weight=0.5,
                           reading_weight=0.5, packing_bins=4)


def picture(height, width, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("size, budget, grid", [
    ((8, 8), 64, (2, 2)),       # native and whole blocks: unchanged
    ((48, 48), 64, (8, 8)),     # shrunk to the budget
    ((3, 5), 64, (2, 2)),       # smaller than one block: one block
    ((20, 200), 64, None),      # 1:10, shrunk
    ((200, 20), 64, None),
    ((4, 400), 16, (2, 8)),     # the short side stays one block
    ((427, 640), 256, None),    # scikit-learn's china.jpg size at a larger budget
])
def test_fit_to_patch_budget_keeps_the_aspect_ratio_within_the_budget(size, budget, grid):
    height, width = size
    image = picture(height, width)
    fitted = fit_to_patch_budget(image, patch_size=PATCH, max_patches=budget)
    rows, cols = fitted.shape[0] // PATCH, fitted.shape[1] // PATCH
    assert fitted.shape == (rows * PATCH, cols * PATCH, 3) and fitted.dtype == np.uint8
    assert rows % 2 == cols % 2 == 0 and rows * cols <= budget
    if grid is not None:
        assert (rows, cols) == grid
    if size == (8, 8):
        assert fitted is image  # native resolution kept
    if height * width > budget * PATCH**2:
        assert rows * cols > budget / 2  # shrunk, but not far below the budget
    # The aspect ratio up to rounding each side to whole blocks: some scale s puts both sides
    # within half a block of s times the native side (or at one block, the least).
    blocks, extent = np.array([rows, cols]) // 2, np.array([height, width]) / (2 * PATCH)
    low = np.max(np.where(blocks > 1, (blocks - 0.5) / extent, 0))
    high = np.min((blocks + 0.5) / extent)
    assert low <= high, (rows, cols)


def test_a_photo_at_native_resolution_fits_the_k3_patch_budget():
    photo = load_sample_image("china.jpg")  # 427 x 640, shipped in scikit-learn's wheel
    fitted = fit_to_patch_budget(photo, patch_size=14, max_patches=16384)
    assert fitted.shape == (420, 644, 3)  # the nearest whole 28-pixel blocks: 15 x 23
    small = fit_to_patch_budget(photo, patch_size=14, max_patches=256)
    assert small.shape[0] * small.shape[1] // 14**2 <= 256


def test_interleaved_example_writes_one_placeholder_run_per_image():
    wide, tall = picture(8, 16, seed=1), picture(24, 8, seed=2)
    example = interleaved_example([b"see ", wide, "and", tall, b"!"], patch_size=PATCH,
                                  max_patches=64, weights=[0.5, 0, 1, None, 2])
    n_wide, n_tall = (2 // 2) * (4 // 2), (6 // 2) * (2 // 2)
    expected = [BOS_ID, *b"see ", IMAGE_START_ID, *[IMAGE_PAD_ID] * n_wide, IMAGE_END_ID,
                *b"and", IMAGE_START_ID, *[IMAGE_PAD_ID] * n_tall, IMAGE_END_ID, *b"!"]
    np.testing.assert_array_equal(example["tokens"], expected)
    assert decode(example["tokens"]).startswith("<bos>see <image_start><image><image><image_end>")
    mask = [0, 0.5, 0.5, 0.5, 0.5, *[0] * (n_wide + 2), 1, 1, 1, *[0] * (n_tall + 2), 2]
    np.testing.assert_array_equal(example["target_mask"], mask)
    patches, coords = zip(*(patchify(image / 127.5 - 1.0, PATCH) for image in (wide, tall)))
    np.testing.assert_allclose(example["patches"], np.concatenate(patches), atol=1e-6)
    np.testing.assert_array_equal(example["patch_coords"], np.concatenate(coords))
    assert len(example["patches"]) == 4 * (n_wide + n_tall)
    with pytest.raises(ValueError, match=r"weights\[1\]=1.0 for an image"):
        interleaved_example([b"x", wide], patch_size=PATCH, max_patches=64, weights=[1, 1.0])
    with pytest.raises(ValueError, match=r"parts\[0\] must be text or an image"):
        interleaved_example([picture(8, 8)[..., :1]], patch_size=PATCH, max_patches=64)


def runs_of(tokens):
    """(start, end) of each placeholder run <image_start> ... <image_end> in a token row."""
    starts = np.flatnonzero(tokens == IMAGE_START_ID)
    ends = np.flatnonzero(tokens == IMAGE_END_ID)
    assert len(starts) == len(ends)
    return list(zip(starts, ends))


def check_batch(batch):
    """The layout of train.multimodal's docstring, row by row."""
    ids, coords = batch["image_segment_ids"], batch["image_positions"]
    for row, tokens in enumerate(batch["tokens"]):
        runs = runs_of(tokens)
        image_ids = [i for i in np.unique(ids[row]) if i]
        assert image_ids == list(range(1, len(runs) + 1))  # images in the order of their runs
        assert not batch["image_pixels"][row][ids[row] == 0].any()
        slot = 0
        for image_id, (start, end) in zip(image_ids, runs):
            where = np.flatnonzero(ids[row] == image_id)
            assert where[0] == slot and np.all(np.diff(where) == 1)  # one run, back to back
            slot += len(where)
            h, w = coords[row, where].max(0) + 1
            np.testing.assert_array_equal(coords[row, where], patch_positions(h, w))
            assert (tokens[start + 1:end] == IMAGE_PAD_ID).all()
            assert end - start - 1 == (h // 2) * (w // 2) == len(where) // 4
            # The run is inside its document: one segment, which starts with BOS.
            segment = batch["segment_ids"][row, start]
            assert (batch["segment_ids"][row, start:end + 1] == segment).all() and segment > 0
            first = np.flatnonzero(batch["segment_ids"][row] == segment)[0]
            assert tokens[first] == BOS_ID and first < start
        assert not ids[row, slot:].any()
    # No loss on predicting any token of an image run.
    assert not batch["loss_mask"][np.isin(batch["targets"], RUN_TOKENS)].any()


@pytest.fixture(scope="module")
def batches():
    iterator = make_multimodal_iterator(MIX)
    return [next(iterator) for _ in range(3)]


def test_batches_pack_images_with_their_documents(batches):
    for batch in batches:
        assert batch["image_pixels"].shape == (4, 96, PATCH * PATCH * 3)
        assert batch["image_segment_ids"].shape == (4, 96)
        assert batch["image_positions"].shape == (4, 96, 2)
        check_batch(batch)
    rows = [tokens for batch in batches for tokens in batch["tokens"]]
    assert sum(len(runs_of(tokens)) > 1 for tokens in rows) > 0  # rows with several images
    assert sum(not runs_of(tokens) for tokens in rows) > 0  # and rows of text only
    images = np.concatenate([b["image_segment_ids"] for b in batches])
    grids = {tuple(b["image_positions"][r][b["image_segment_ids"][r] == i].max(0))
             for b in batches for r in range(4) for i in range(1, 6)
             if (b["image_segment_ids"][r] == i).any()}
    assert len(grids) > 3 and images.max() > 1  # images of several sizes share a row


def test_the_loss_counts_the_answers_of_image_rows():
    examples = image_task_examples(MIX, "colour", "held_out", seed=0)
    batch = finalize_multimodal_batch(
        {key: np.stack([_alone_in_a_row(MIX, examples[i])[key] for i in range(2)])
         for key in _alone_in_a_row(MIX, examples[0])})
    check_batch(batch)
    for row, answer in enumerate((b"red", b"green")):
        counted = batch["loss_mask"][row] > 0
        assert bytes(batch["targets"][row][counted].astype(np.uint8)) == answer


def test_answers_weigh_answer_weight_in_training_only():
    weighted = dataclasses.replace(MIX, answer_weight=3.0)
    for split, weight in (("train", 3.0), ("held_out", 1.0)):
        example = image_task_examples(weighted, "digits", split, seed=0)[1]
        np.testing.assert_array_equal(example["target_mask"][-1:], [weight])  # the answer byte
        assert not example["target_mask"][:-1].any()


def test_a_misaligned_placeholder_count_is_refused():
    examples = image_task_examples(MIX, "digits", "held_out", seed=0)
    row = _alone_in_a_row(MIX, examples[0])
    row["tokens"] = np.where(row["tokens"] == IMAGE_PAD_ID, 65, row["tokens"])  # run dropped
    with pytest.raises(ValueError, match="row 0 has 0 image placeholders but its images have 1"):
        finalize_multimodal_batch({key: value[None] for key, value in row.items()})


def test_the_iterator_resumes_exactly(tmp_path):
    """From its grain state, and through an orbax checkpoint as the trainer saves it."""
    iterator = make_multimodal_iterator(MIX)
    for _ in range(2):
        next(iterator)
    state = iterator.get_state()
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
        manager.wait_until_finished()
    expected = [next(iterator) for _ in range(2)]
    resumed = make_multimodal_iterator(MIX)
    resumed.set_state(state)
    restored = make_multimodal_iterator(MIX)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore(2, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(restored)))
    for again in (resumed, restored):
        for want, got in zip(expected, [next(again) for _ in range(2)]):
            assert want.keys() == got.keys()
            for key in want:
                np.testing.assert_array_equal(want[key], got[key], err_msg=key)
    other_seed = next(make_multimodal_iterator(dataclasses.replace(MIX, seed=4)))
    assert not np.array_equal(other_seed["tokens"], expected[0]["tokens"])


def test_zeroed_control_changes_only_the_pixels(batches):
    zeroed = make_multimodal_iterator(dataclasses.replace(MIX, vision_control="zeroed"))
    for batch in batches:
        control = next(zeroed)
        for key in batch:
            if key != "image_pixels":
                np.testing.assert_array_equal(control[key], batch[key], err_msg=key)
        assert not control["image_pixels"].any() and batch["image_pixels"].any()


def test_shuffled_control_shows_every_held_out_image_once_never_its_own():
    data = dataclasses.replace(MIX, colour=ShapeColour(held_out=12), batch_size=12)
    partners = [_shuffled_partner("held_out", i, 0, 12) for i in range(12)]
    assert sorted(partners) == list(range(12)) and all(p != i for i, p in enumerate(partners))
    plain = make_image_task_batches(data, "colour")[0]
    shuffled = make_image_task_batches(dataclasses.replace(data, vision_control="shuffled"),
                                       "colour")[0]
    check_batch(shuffled)
    np.testing.assert_array_equal(shuffled["targets"][shuffled["loss_mask"] > 0],
                                  plain["targets"][plain["loss_mask"] > 0])  # the same answers
    images = [plain["image_pixels"][r][plain["image_segment_ids"][r] > 0] for r in range(12)]
    for row in range(12):
        shown = shuffled["image_pixels"][row][shuffled["image_segment_ids"][row] > 0]
        matches = [r for r in range(12) if images[r].shape == shown.shape
                   and np.array_equal(images[r], shown)]
        assert matches and row not in matches


def test_held_out_batches_hold_one_example_a_row():
    batches = make_image_task_batches(MIX, "digits")
    assert len(batches) == 75  # 300 held-out digits, 4 a batch
    batch = batches[74]
    check_batch(batch)
    assert (batch["segment_ids"].max(1) == 1).all()
    answers = batch["targets"][batch["loss_mask"] > 0]
    assert len(answers) == 4 and set(answers) <= set(b"0123456789")


def test_text_batches_have_no_images_and_partial_image_arrays_are_refused(batches):
    assert batch_images({"tokens": np.zeros((1, 4))}) is None
    images = batch_images(batches[0])
    np.testing.assert_array_equal(images.segment_ids, batches[0]["image_segment_ids"])
    with pytest.raises(ValueError, match="needs all of"):
        batch_images({key: batches[0][key] for key in IMAGE_KEYS[:2]})


@pytest.mark.parametrize("changes, message", [
    (dict(row_patches=16), "row_patches=16 is below image_patches=32"),
    (dict(image_patches=30), "image_patches=30 is invalid"),
    (dict(mqar_weight=0.1), "mqar_weight=0.1"),
    (dict(vision_control="blurred"), "vision_control"),
    (dict(answer_weight=0.0), "answer_weight"),
])
def test_invalid_settings_raise_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MIX, **changes)


def test_an_example_longer_than_the_row_is_refused():
    data = dataclasses.replace(MIX, seq_len=16)
    with pytest.raises(ValueError, match="more than seq_len=16"):
        image_task_examples(data, "colour", "held_out", seed=0)[0]


TOWER = VisionConfig(patch_size=PATCH, width=16, num_layers=1, num_heads=2, head_dim=8,
                     mlp_hidden=32, pos_table=(8, 8), image_token_id=IMAGE_PAD_ID)
# Two layers (KDA with a dense FFN, MLA with MoE) and a one-block tower: quick to compile.
SMALL_MODEL = preset("tiny", num_layers=2, kda_layers=(1,), full_attn_layers=(2,), vision=TOWER)
# One KDA layer with a dense FFN: the quickest training step to compile.
ONE_LAYER_MODEL = preset("tiny", num_layers=1, kda_layers=(1,), full_attn_layers=(),
                         first_k_dense=1, vision=TOWER)


def test_the_model_must_fit_the_data():
    with pytest.raises(ValueError, match="model has no vision tower"):
        check_model_fits(preset("tiny"), MIX)
    with pytest.raises(ValueError, match="model.vision.patch_size=8"):
        TrainConfig(model=preset("tiny", vision=dataclasses.replace(TOWER, patch_size=8)),
                    data=MIX)
    with pytest.raises(ValueError, match="model.vision.image_token_id=261"):
        TrainConfig(model=preset("tiny", vision=dataclasses.replace(TOWER, image_token_id=261)),
                    data=MIX)
    check_model_fits(preset("tiny"), DataConfig())  # text fits any model


@pytest.mark.slow
def test_packed_documents_with_images_equal_each_document_alone(batches):
    """The forward on a packed batch equals, at every token of a document, the forward on that
    document alone in its row: images reach their own placeholders, and segments keep the
    documents apart (KDA resets, MLA masks) with their images inside them."""
    model = init_sharded(lambda: HybridLM(SMALL_MODEL, rngs=nnx.Rngs(0)),
                         make_mesh(devices=jax.devices()[:1]))  # one program, not op by op
    forward = jax.jit(lambda model, batch: model(batch["tokens"], batch["segment_ids"],
                                                 batch_images(batch)))
    batch = next(b for b in batches if len(runs_of(b["tokens"][0])) > 1)
    segments = batch["segment_ids"][0]
    documents = [s for s in np.unique(segments) if s][:MIX.batch_size]
    rows = []
    for segment in documents:
        where = segments == segment
        slots = batch["image_segment_ids"][0] > 0
        document_images = np.isin(batch["image_segment_ids"][0],
                                  _images_of(batch, 0, where))
        example = {"tokens": batch["tokens"][0][where],
                   "target_mask": np.ones(where.sum(), np.float32),
                   "patches": batch["image_pixels"][0][slots & document_images],
                   "patch_coords": batch["image_positions"][0][slots & document_images]}
        rows.append(_alone_in_a_row(MIX, example))
    alone = finalize_multimodal_batch({key: np.stack([row[key] for row in rows])
                                       for key in rows[0]}, batch_size=MIX.batch_size)
    packed_logits = np.asarray(forward(model, batch))
    alone_logits = np.asarray(forward(model, alone))
    for index, segment in enumerate(documents):
        where = segments == segment
        np.testing.assert_allclose(packed_logits[0][where], alone_logits[index][:where.sum()],
                                   rtol=1e-5, atol=1e-5)


def _images_of(batch, row, where):
    """The image ids (image_segment_ids) of the placeholder runs inside the tokens `where`."""
    runs = runs_of(batch["tokens"][row])
    return [index + 1 for index, (start, _) in enumerate(runs) if where[start]]


@pytest.mark.slow
def test_the_train_and_eval_steps_read_the_images(batches):
    """The same batch with its pixels zeroed gives another loss and other predictions: the
    step passes the images to the model (and text rows alone would not notice)."""
    config = TrainConfig(model=ONE_LAYER_MODEL, data=MIX, fast_compile=True, progress=False,
                         mesh=MeshConfig(data=1))
    trainer = Trainer.create(config)
    initial = jax.tree.map(jnp.copy, trainer.state)
    batch = batches[0]
    zeroed = dict(batch, image_pixels=np.zeros_like(batch["image_pixels"]))
    evaluated = [trainer.eval_step(initial, trainer.place(b)) for b in (batch, zeroed)]
    assert float(evaluated[0]["nll"]) != float(evaluated[1]["nll"])
    losses = []
    for b in (batch, zeroed):
        trainer.state = jax.tree.map(jnp.copy, initial)
        metrics = trainer.step(b)
        assert float(metrics["skipped"]) == 0.0
        losses.append(float(metrics["loss"]))
    assert losses[0] != losses[1] and all(np.isfinite(losses))
