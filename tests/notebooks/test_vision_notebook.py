"""notebooks/vision.ipynb runs top to bottom, at the tiny size of the vision quickstart's short
run, in the project's interpreter."""

import re

import pytest

pytest.importorskip("nbclient")
from tests.experiments.test_vision_quickstart import SHORT_RUN  # noqa: E402
from tests.notebooks.runner import execute_notebook, images, printed  # noqa: E402

# The quickstart test's short run (its model, rows, tower and step count: the same compiled step,
# whose learning-rate schedule depends on the step count), on digits alone, with 10 held-out
# digits.
SETTINGS = {**SHORT_RUN, "data.digits_weight": 1.0, "data.colour_weight": 0,
            "data.digits.held_out_per_class": 1}


@pytest.mark.slow
def test_notebook_executes():
    """The kernel keeps the suite's XLA flags (conftest), so the compilation cache holds the
    step the quickstart's test compiled with these shapes."""
    outputs = execute_notebook("vision.ipynb", f"SETTINGS = {SETTINGS!r}")
    text = printed(outputs)
    # Four images of at most 16 patches (each 2 x 2 block one merged token) and the padding
    # fill the row's 64 slots; the 8 x 8 digit is 2 x 2 patches.
    packed = [tuple(map(int, found)) for found in
              re.findall(r"image \d: (\d+) patches -> (\d+) merged tokens", text)]
    assert len(packed) == 4 and packed[0] == (4, 1)
    assert all(4 <= patches <= 16 and merged * 4 == patches for patches, merged in packed)
    padding = int(re.search(r"padding: (\d+) slots", text).group(1))
    assert sum(patches for patches, _ in packed) + padding == 64
    assert "image placeholders; the buffer holds" in text and "logits (1, " in text
    assert "loss: " in text and f"after {SHORT_RUN['steps']} steps" in text
    assert "held-out digits exact match: " in text and "of 10 (chance 10%)" in text
    assert images(outputs) == 3
