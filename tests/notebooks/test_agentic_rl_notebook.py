"""notebooks/agentic_rl.ipynb runs top to bottom, at the tiny size of the experiment's test, in the
project's interpreter."""

import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402

from tests.experiments.test_agentic_rl import SETTINGS  # noqa: E402

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(REPOSITORY, "notebooks", "agentic_rl.ipynb")


@pytest.mark.slow
def test_notebook_executes():
    """The kernel keeps the suite's XLA flags (conftest), so the compilation cache holds the
    programs the experiment's test compiled with these settings."""
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert os.path.realpath(spec.resource_dir).startswith(os.path.realpath(sys.prefix))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    [parameters] = [cell for cell in notebook.cells
                    if "parameters" in cell.metadata.get("tags", [])]
    parameters.source = f"SETTINGS = {SETTINGS!r}"
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": REPOSITORY}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.outputs]
    text = "".join(output.get("text", "") for output in outputs)
    assert "loss: " in text and "advantage" in text and "iteration 2: reward" in text
    assert "pass@1: " in text and "guess_rate: " in text
    assert any("image/png" in output.get("data", {}) for output in outputs)
