"""The image question-answer tasks: seeded random access, held-out splits that never meet
training and hold balanced answers, and images that show their answers (colour present, shapes
counted as connected blobs)."""

import collections

import numpy as np
import pytest
from scipy import ndimage

from train.image_tasks import (PALETTE, Digits, RenderedNumber, ShapeColour, ShapeCount,
                               _digit_images, _digits_split)

TASKS = [Digits(), ShapeColour(), ShapeCount(), RenderedNumber()]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_examples_are_seeded_random_access_and_answers_are_valid(task):
    first = task.example("train", 7, seed=3)
    again = task.example("train", 7, seed=3)
    np.testing.assert_array_equal(first.image, again.image)
    assert (first.question, first.answer) == (again.question, again.answer)
    assert first.image.dtype == np.uint8 and first.image.ndim == 3 and first.image.shape[2] == 3
    others = [task.example("train", index, seed) for index, seed in ((8, 3), (7, 4))]
    assert all(not np.array_equal(first.image, other.image) for other in others)
    draws = [task.example("train", index, seed=0) for index in range(60)]
    assert {qa.answer for qa in draws} <= set(task.answers())
    assert len({qa.answer for qa in draws}) > 1


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_held_out_answers_are_balanced(task):
    counts = collections.Counter(task.example("held_out", index, seed=0).answer
                                 for index in range(task.held_out_size()))
    assert set(counts) == set(task.answers())
    assert max(counts.values()) - min(counts.values()) <= 1  # a constant guess scores chance


def test_digits_held_out_images_never_train():
    split = _digits_split(30)
    images, labels = _digit_images()
    assert np.intersect1d(split["train"], split["held_out"]).size == 0
    assert split["train"].size + split["held_out"].size == labels.size == 1797
    assert (np.bincount(labels[split["held_out"]]) == 30).all()
    task = Digits()
    training_images = {images[i].tobytes() for i in split["train"]}
    assert all(task.example("train", index, seed=1).image.tobytes() in training_images
               for index in range(400))
    for index in (0, 150, 299):
        qa = task.example("held_out", index, seed=5)
        image_index = split["held_out"][index]
        np.testing.assert_array_equal(qa.image, images[image_index])
        assert qa.answer == str(labels[image_index]).encode()
    with pytest.raises(ValueError, match="held-out index 300"):
        task.example("held_out", 300, seed=0)


def test_colour_images_show_their_colour_and_no_other():
    task = ShapeColour()
    shapes = set()
    for index in range(40):
        qa = task.example("train", index, seed=2)
        pixels = {tuple(p) for p in qa.image.reshape(-1, 3)}
        present = {name.encode() for name, rgb in PALETTE.items() if rgb in pixels}
        assert present == {qa.answer}
        shapes.add(np.sign(qa.image.shape[0] - qa.image.shape[1]))
    assert shapes >= {-1, 1}  # portrait and landscape canvases


def test_count_images_hold_as_many_separate_shapes_as_the_answer():
    task = ShapeCount()
    for index in range(40):
        qa = task.example("train", index, seed=2)
        # Shapes never touch (a one-pixel gap), so each is one 8-connected blob; a corner pixel
        # could be a shape, so read the background as the most common colour.
        colours, counts = np.unique(qa.image.reshape(-1, 3), axis=0, return_counts=True)
        background = colours[np.argmax(counts)]
        foreground = (qa.image != background).any(-1)
        _, blobs = ndimage.label(foreground, structure=np.ones((3, 3)))
        assert blobs == int(qa.answer), index


def test_rendered_numbers_differ_by_their_text():
    task = RenderedNumber()
    qa = task.example("held_out", 5, seed=0)
    assert qa.answer == b"15" and (qa.image < 128).any()  # dark text on a light canvas
    assert len({task.example("held_out", i, seed=0).image.tobytes() for i in range(20)}) == 20


@pytest.mark.parametrize("make, field", [
    (lambda: ShapeColour(colours=1), "colours"),
    (lambda: ShapeColour(sides=(4, 40)), "sides"),
    (lambda: ShapeCount(max_count=12), "max_count"),
    (lambda: ShapeCount(shape_sizes=(4, 30)), "shape_sizes"),
    (lambda: RenderedNumber(widths=(10, 40)), "widths"),
    (lambda: Digits(held_out_per_class=0), "held_out_per_class"),
])
def test_invalid_settings_raise_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()
