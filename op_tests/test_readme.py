"""The README's Python code blocks run as written on the CPU (each in a fresh namespace), and the
README stays short. Its bash blocks are install commands: .ci/run runs the Quick start's verbatim
in a fresh virtual environment."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_is_short_and_has_examples():
    assert len(README.read_text().splitlines()) <= 200
    assert len(python_blocks()) >= 4  # training, TE switch, serving switch, core ops


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index):
    code = python_blocks()[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme"})
