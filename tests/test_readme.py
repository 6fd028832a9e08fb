"""The README's examples run as written."""

import pathlib
import re

import pytest

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_examples():
  assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
  if "import torch" in BLOCKS[index]:
    pytest.importorskip("torch")
  exec(compile(BLOCKS[index], f"README.md example {index}", "exec"), {})  # pylint: disable=exec-used
