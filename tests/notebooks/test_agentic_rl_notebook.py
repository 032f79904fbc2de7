"""notebooks/agentic_rl.ipynb runs top to bottom, at the tiny size of the experiment's test, in the
project's interpreter."""

import pytest

pytest.importorskip("nbclient")
from tests.experiments.test_agentic_rl import SETTINGS  # noqa: E402
from tests.notebooks.runner import execute_notebook, images, printed  # noqa: E402


@pytest.mark.slow
def test_notebook_executes():
    """The kernel keeps the suite's XLA flags (conftest), so the compilation cache holds the
    programs the experiment's test compiled with these settings."""
    outputs = execute_notebook("agentic_rl.ipynb", f"SETTINGS = {SETTINGS!r}")
    text = printed(outputs)
    assert "loss: " in text and "advantage" in text and "iteration 2: reward" in text
    assert "pass@1: " in text and "guess_rate: " in text
    assert images(outputs) > 0
