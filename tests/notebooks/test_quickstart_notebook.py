"""notebooks/quickstart.ipynb runs top to bottom (at a tiny size) in the project's interpreter."""

import pytest

pytest.importorskip("nbclient")
from tests.notebooks.runner import execute_notebook, images, printed  # noqa: E402

# One KDA layer with a dense FFN: the notebook's cells do not depend on the layer mix, and each
# layer kind adds to every compile (the init, the step, evaluation, prefill and decode);
# tests/experiments/test_quickstart.py trains both mixers and the MoE.
SMALL = """\
PRESET = "tiny"
MODEL_OVERRIDES = {"num_layers": 1, "kda_layers": (1,), "full_attn_layers": ()}
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
