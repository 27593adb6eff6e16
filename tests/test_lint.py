"""ruff holds over src/ and tests/: its lint rules and its formatting, as configured in pyproject.toml.

``tools/lint_fix.sh`` applies every automatic fix and the formatting; what it cannot fix, fix by hand
(or, where a rule does not fit one line, say why in a ``# noqa: CODE - reason`` comment).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str:
    """The ruff of this environment (installed with the `test` extra, pinned in constraints.txt)."""
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -c constraints.txt -e '.[test]'")
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_finds_nothing() -> None:
    result = _run("check", "--no-cache", "--output-format", "concise", "src", "tests")
    assert result.returncode == 0, f"ruff check (fix with tools/lint_fix.sh):\n{result.stdout}{result.stderr}"


def test_ruff_format_changes_nothing() -> None:
    result = _run("format", "--no-cache", "--check", "src", "tests")
    assert result.returncode == 0, f"ruff format (apply with tools/lint_fix.sh):\n{result.stdout}{result.stderr}"
