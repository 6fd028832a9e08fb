"""The README's example runs as written."""

import pathlib
import re


def test_readme_example_runs():
  readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
  code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
  exec(compile(code, "README.md", "exec"), {})  # pylint: disable=exec-used
