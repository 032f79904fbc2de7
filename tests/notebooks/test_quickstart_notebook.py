"""notebooks/quickstart.ipynb runs top to bottom (at a tiny size) in the project's interpreter."""

import pytest

pytest.importorskip("nbclient")
from tests.notebooks.runner import execute_notebook, images, printed  # noqa: E402

SMALL = """\
PRESET = "tiny"
MODEL_OVERRIDES = {"num_layers": 2, "kda_layers": (1,), "full_attn_layers": (2,)}
STEPS = 3
SEQ_LEN = 32
BATCH_SIZE = 2
SAMPLE_BYTES = 4
FAST_COMPILE = True
"""


@pytest.mark.slow
def test_notebook_executes(one_device_xla_flags):
    outputs = execute_notebook("quickstart.ipynb", SMALL)
    text = printed(outputs)
    assert "loss:" in text and "validation:" in text and "bits per byte" in text
    assert images(outputs) > 0
