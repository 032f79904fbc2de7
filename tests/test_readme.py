"""The READMEs' Python examples run as written, so the documentation cannot drift from the code."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = ("README.md", "models/README.md")


@pytest.mark.slow
@pytest.mark.parametrize("readme", READMES)
def test_readme_examples_run_top_to_bottom(readme):
    examples = re.findall(r"```python\n(.*?)```", (ROOT / readme).read_text(), re.S)
    assert examples
    namespace = {}  # later examples build on earlier ones, as a reader runs them
    for index, example in enumerate(examples):
        exec(compile(example, f"{readme} python example {index}", "exec"), namespace)
