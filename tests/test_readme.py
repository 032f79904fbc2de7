"""The README's Python examples run as written, so the documentation cannot drift from the code."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run_top_to_bottom():
    examples = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert examples
    namespace = {}  # later examples build on earlier ones, as a reader runs them
    for index, example in enumerate(examples):
        exec(compile(example, f"README.md python example {index}", "exec"), namespace)
