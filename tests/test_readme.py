"""The Python examples of the README and the user guide run as written (each block a script, in a fresh folder)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The README is a front page; its longer Python examples live in the user guide's pages.
PAGES = [
    ROOT / "README.md",
    ROOT / "docs" / "guide" / "python.md",
    ROOT / "docs" / "guide" / "your-model.md",
    ROOT / "docs" / "guide" / "train.md",
]
BLOCKS = [block for page in PAGES for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)]


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(tmp_path: Path, index: int) -> None:
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[index])
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()
