"""notebooks/quickstart.ipynb runs top to bottom (at a tiny size) in the project's interpreter."""

import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "notebooks",
                        "quickstart.ipynb")
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
def test_notebook_executes(tmp_path, one_device_xla_flags):
    # The "python3" kernel must be this interpreter's (the venv's), not a global one.
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert os.path.realpath(spec.resource_dir).startswith(os.path.realpath(sys.prefix))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    [parameters] = [cell for cell in notebook.cells
                    if "parameters" in cell.metadata.get("tags", [])]
    parameters.source = SMALL
    repo = os.path.dirname(os.path.dirname(NOTEBOOK))
    client = nbclient.NotebookClient(
        notebook, kernel_name="python3", timeout=600,
        resources={"metadata": {"path": repo}},
    )
    client.execute()
    outputs = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert "loss:" in outputs and "validation:" in outputs and "bits per byte" in outputs
    assert any(
        "image/png" in output.get("data", {})
        for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
