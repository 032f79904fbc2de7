"""Image question-answer tasks from data the installed packages carry (no download at run time):
scikit-learn's bundled handwritten digits, and images drawn with Pillow.

    task = ShapeColour()
    qa = task.example("train", index=12, seed=0)   # ImageQA(image, question, answer)
    qa.image                                        # uint8 [H, W, 3], the task's native size
    task.held_out_size()                            # examples in the held-out split
    task.answers()                                  # every answer (chance: 1 / len)

Every example depends only on (task, split, index, seed): random access, no files. The held-out
split never meets training: `Digits` holds out a fixed 30 images of each digit (by a hash of
their index, whatever the seed), and the drawn tasks draw each split from its own seed stream.
Answers are equally likely in training and balanced in the held-out split (held-out example i
has the (i mod number of answers)-th answer), so a model that ignores the image, answering
always the same, scores chance: 1 / the number of answers.

- `Digits`: an 8 x 8 digit (scikit-learn's `load_digits`), "Which digit? " -> "7".
- `ShapeColour`: one to a few shapes of one colour on a grey canvas of random aspect ratio,
  "What colour? " -> "red" (each colour's first byte is its own).
- `ShapeCount`: one to five non-overlapping shapes of random colours, "How many shapes? " -> "3".
- `RenderedNumber`: a two-digit number in Pillow's built-in font at a random place and size,
  "What number? " -> "47".
"""

import dataclasses
import functools
import zlib
from typing import ClassVar, Literal, NamedTuple

import numpy as np
from PIL import Image, ImageDraw, ImageFont

Split = Literal["train", "held_out"]
SPLITS = ("train", "held_out")
# Colours that stay apart after resizing, on any grey; their names' first bytes all differ, so
# the first answer byte decides the answer.
PALETTE = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 205, 40),
    "purple": (150, 60, 190),
    "orange": (245, 135, 30),
}
SHAPES = ("ellipse", "rectangle", "triangle")


class ImageQA(NamedTuple):
    """One example: image uint8 [H, W, 3], the question's and the answer's bytes."""

    image: np.ndarray
    question: bytes
    answer: bytes


def _rng(task: str, split: Split, index: int, seed: int) -> np.random.Generator:
    """The generator of one example; the task's name and the split keep streams apart."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= seed < 2**63 or not 0 <= index < 2**63:
        raise ValueError(f"seed and index must be integers in [0, 2**63), got seed={seed}, "
                         f"index={index}")
    return np.random.default_rng([seed, zlib.crc32(task.encode()), SPLITS.index(split), index])


def _check_positive(owner, **values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(owner).__name__}.{name} must be a positive int, got "
                             f"{value!r}")


def _check_range(owner, name: str, smallest: int) -> None:
    """Raises ValueError naming owner's field `name` unless it is (low, high) with smallest <=
    low <= high."""
    value = getattr(owner, name)
    if not (len(value) == 2 and all(isinstance(v, int) for v in value)
            and smallest <= value[0] <= value[1]):
        raise ValueError(f"{type(owner).__name__}.{name}={value} is invalid: expected (low, high) "
                         f"pixels, integers with {smallest} <= low <= high")


@functools.cache
def _digit_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits as uint8 [N, 8, 8, 3] (0..16 scaled to 0..255) and labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    grey = np.round(digits.images * (255 / 16)).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=-1), digits.target.astype(np.int64)


@functools.cache
def _digits_split(per_class: int) -> dict[str, np.ndarray]:
    """Image indices of each split: held out, of each class the per_class images whose index
    has the smallest crc32 (fixed, whatever the seed; balanced, so a constant guess scores
    chance); train, the others."""
    labels = _digit_images()[1]
    hashes = np.array([zlib.crc32(str(i).encode()) for i in range(labels.size)])
    chosen = [np.flatnonzero(labels == d)[np.argsort(hashes[labels == d])[:per_class]]
              for d in range(10)]
    held_out = np.sort(np.concatenate(chosen))
    return {"held_out": held_out, "train": np.setdiff1d(np.arange(labels.size), held_out)}


@dataclasses.dataclass(frozen=True)
class Digits:
    """scikit-learn's handwritten digits (8 x 8, white on black): "Which digit? " -> "0".."9".

    held_out_per_class: images of each digit held out (`_digits_split`); the held-out split
        is those 10 x held_out_per_class images in index order, and a training example is one
        of the others, drawn at random.
    """

    held_out_per_class: int = 30
    name: ClassVar[str] = "digits"
    question: ClassVar[bytes] = b"Which digit? "

    def __post_init__(self):
        _check_positive(self, held_out_per_class=self.held_out_per_class)
        if self.held_out_per_class > 150:
            raise ValueError(f"Digits.held_out_per_class must be at most 150 (the rarest digit "
                             f"has 174 images), got {self.held_out_per_class}")

    def answers(self) -> tuple[bytes, ...]:
        return tuple(str(d).encode() for d in range(10))

    def held_out_size(self) -> int:
        return 10 * self.held_out_per_class

    def example(self, split: Split, index: int, seed: int) -> ImageQA:
        """Training: a random image of the training share; held out: the index-th held-out
        image (index below `held_out_size`)."""
        rng = _rng(self.name, split, index, seed)
        images, labels = _digit_images()
        members = _digits_split(self.held_out_per_class)[split]
        if split == "held_out" and index >= members.size:
            raise ValueError(f"Digits held-out index {index} is out of range: the split has "
                             f"{members.size} images")
        image_index = members[index] if split == "held_out" else rng.choice(members)
        return ImageQA(images[image_index], self.question, str(labels[image_index]).encode())


def _answer_index(rng: np.random.Generator, split: Split, index: int, count: int) -> int:
    """Which of `count` answers an example has: random in training; in the held-out split
    example i has answer i % count, so held-out answers are balanced."""
    return index % count if split == "held_out" else int(rng.integers(count))


def _canvas(rng: np.random.Generator, sides: tuple[int, int]) -> Image.Image:
    """A canvas of random height and width (so random aspect ratio) in a random light grey."""
    height, width = rng.integers(sides[0], sides[1] + 1, size=2)
    return Image.new("RGB", (int(width), int(height)), (int(rng.integers(150, 256)),) * 3)


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int],
                colour: tuple[int, int, int]) -> None:
    left, top, right, bottom = box
    if kind == "ellipse":
        draw.ellipse(box, fill=colour)
    elif kind == "rectangle":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((left + right) / 2, top), (right, bottom), (left, bottom)], fill=colour)


def _random_box(rng: np.random.Generator, canvas: Image.Image, size_range: tuple[int, int]):
    """A square box of random side in size_range, inside the canvas (left, top, right, bottom)."""
    width, height = canvas.size
    side = int(rng.integers(size_range[0], min(size_range[1], width, height) + 1))
    left = int(rng.integers(0, width - side + 1))
    top = int(rng.integers(0, height - side + 1))
    return left, top, left + side - 1, top + side - 1


def _overlaps(box, others, gap: int = 1) -> bool:
    return any(box[0] <= o[2] + gap and o[0] <= box[2] + gap and box[1] <= o[3] + gap
               and o[1] <= box[3] + gap for o in others)


@dataclasses.dataclass(frozen=True)
class ShapeColour:
    """Shapes of one colour (ellipses, squares, triangles) on a grey canvas: "What colour? ".

    colours: the first `colours` names of PALETTE are the answers (2: red and green).
    max_shapes: 1..max_shapes shapes (may overlap), each side in shape_sizes pixels.
    sides: the canvas's height and width, each uniform in [low, high] pixels.
    held_out: examples in the held-out split.
    """

    colours: int = len(PALETTE)
    max_shapes: int = 3
    shape_sizes: tuple[int, int] = (6, 16)
    sides: tuple[int, int] = (16, 48)
    held_out: int = 300
    name: ClassVar[str] = "colour"
    question: ClassVar[bytes] = b"What colour? "

    def __post_init__(self):
        _check_positive(self, colours=self.colours, max_shapes=self.max_shapes,
                        held_out=self.held_out)
        if not 2 <= self.colours <= len(PALETTE):
            raise ValueError(f"ShapeColour.colours must lie in [2, {len(PALETTE)}], got "
                             f"{self.colours}")
        _check_range(self, "shape_sizes", 3)
        _check_range(self, "sides", self.shape_sizes[0])

    def answers(self) -> tuple[bytes, ...]:
        return tuple(name.encode() for name in list(PALETTE)[:self.colours])

    def held_out_size(self) -> int:
        return self.held_out

    def example(self, split: Split, index: int, seed: int) -> ImageQA:
        rng = _rng(self.name, split, index, seed)
        name = list(PALETTE)[_answer_index(rng, split, index, self.colours)]
        canvas = _canvas(rng, self.sides)
        draw = ImageDraw.Draw(canvas)
        for _ in range(rng.integers(1, self.max_shapes + 1)):
            _draw_shape(draw, SHAPES[rng.integers(len(SHAPES))],
                        _random_box(rng, canvas, self.shape_sizes), PALETTE[name])
        return ImageQA(np.asarray(canvas), self.question, name.encode())


@dataclasses.dataclass(frozen=True)
class ShapeCount:
    """1..max_count non-overlapping shapes of random colours: "How many shapes? " -> "3".

    shape_sizes, sides: as `ShapeColour`'s; held_out: examples in the held-out split.
    """

    max_count: int = 5
    shape_sizes: tuple[int, int] = (4, 8)
    sides: tuple[int, int] = (32, 48)
    held_out: int = 300
    name: ClassVar[str] = "count"
    question: ClassVar[bytes] = b"How many shapes? "

    def __post_init__(self):
        _check_positive(self, max_count=self.max_count, held_out=self.held_out)
        if self.max_count > 9:
            raise ValueError(f"ShapeCount.max_count must be at most 9 (one-digit answers), got "
                             f"{self.max_count}")
        _check_range(self, "shape_sizes", 3)
        _check_range(self, "sides", self.shape_sizes[1])
        if self.max_count * (self.shape_sizes[1] + 2) ** 2 > self.sides[0] ** 2 // 2:
            raise ValueError(f"ShapeCount: {self.max_count} shapes of up to {self.shape_sizes[1]} "
                             f"pixels do not fit a {self.sides[0]}-pixel canvas side with room to "
                             "spare; shrink max_count or shape_sizes, or raise sides")

    def answers(self) -> tuple[bytes, ...]:
        return tuple(str(n).encode() for n in range(1, self.max_count + 1))

    def held_out_size(self) -> int:
        return self.held_out

    def example(self, split: Split, index: int, seed: int) -> ImageQA:
        rng = _rng(self.name, split, index, seed)
        count = 1 + _answer_index(rng, split, index, self.max_count)
        while True:  # rejection sampling of non-overlapping boxes; the check above leaves room
            canvas = _canvas(rng, self.sides)
            boxes = []
            for _ in range(100 * count):
                box = _random_box(rng, canvas, self.shape_sizes)
                if not _overlaps(box, boxes):
                    boxes.append(box)
                    if len(boxes) == count:
                        break
            if len(boxes) == count:
                break
        draw = ImageDraw.Draw(canvas)
        colours = list(PALETTE.values())
        for box in boxes:
            _draw_shape(draw, SHAPES[rng.integers(len(SHAPES))], box,
                        colours[rng.integers(len(colours))])
        return ImageQA(np.asarray(canvas), self.question, str(count).encode())


@functools.cache
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


@dataclasses.dataclass(frozen=True)
class RenderedNumber:
    """A number from 10 to 99 in Pillow's built-in font, dark on light, at a random place and
    size on a canvas of random width: "What number? " -> "47".

    font_sizes: the font's pixel size, uniform in [low, high]; heights, widths: the canvas's,
    (low, high) pixels each; held_out: examples in the held-out split.
    """

    font_sizes: tuple[int, int] = (11, 15)
    heights: tuple[int, int] = (16, 24)
    widths: tuple[int, int] = (32, 48)
    held_out: int = 300
    name: ClassVar[str] = "reading"
    question: ClassVar[bytes] = b"What number? "

    def __post_init__(self):
        _check_positive(self, held_out=self.held_out)
        _check_range(self, "font_sizes", 6)
        _check_range(self, "heights", self.font_sizes[1])
        _check_range(self, "widths", 2 * self.font_sizes[1])

    def answers(self) -> tuple[bytes, ...]:
        return tuple(str(n).encode() for n in range(10, 100))

    def held_out_size(self) -> int:
        return self.held_out

    def example(self, split: Split, index: int, seed: int) -> ImageQA:
        rng = _rng(self.name, split, index, seed)
        text = str(10 + _answer_index(rng, split, index, 90))
        height = int(rng.integers(self.heights[0], self.heights[1] + 1))
        width = int(rng.integers(self.widths[0], self.widths[1] + 1))
        canvas = Image.new("RGB", (width, height), (int(rng.integers(190, 256)),) * 3)
        draw = ImageDraw.Draw(canvas)
        font = _font(int(rng.integers(self.font_sizes[0], self.font_sizes[1] + 1)))
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        x = int(rng.integers(0, max(width - (right - left), 0) + 1)) - left
        y = int(rng.integers(0, max(height - (bottom - top), 0) + 1)) - top
        draw.text((x, y), text, fill=(int(rng.integers(0, 80)),) * 3, font=font)
        return ImageQA(np.asarray(canvas), self.question, text.encode())


ImageTask = Digits | ShapeColour | ShapeCount | RenderedNumber
