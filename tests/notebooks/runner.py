"""Runs a notebook of `notebooks/` top to bottom in the project's interpreter (the venv's
"python3" kernel), its parameters cell replaced: how the suite executes every notebook."""

import os
import sys

import nbclient
import nbformat
from jupyter_client.kernelspec import KernelSpecManager

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def execute_notebook(name: str, parameters: str) -> list[dict]:
    """Executes `notebooks/<name>` with the source of its cell tagged "parameters" replaced by
    `parameters`, in the repository's root; the outputs of its code cells, in order."""
    # The "python3" kernel must be this interpreter's (the venv's), not a global one.
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert os.path.realpath(spec.resource_dir).startswith(os.path.realpath(sys.prefix))
    notebook = nbformat.read(os.path.join(REPOSITORY, "notebooks", name), as_version=4)
    [cell] = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    cell.source = parameters
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": REPOSITORY}}).execute()
    return [output for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.outputs]


def printed(outputs: list[dict]) -> str:
    """The text the cells printed."""
    return "".join(output.get("text", "") for output in outputs)


def images(outputs: list[dict]) -> int:
    """How many PNG figures the cells showed."""
    return sum("image/png" in output.get("data", {}) for output in outputs)
