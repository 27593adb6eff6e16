"""ruff holds over src/ and tests/: its lint rules and its formatting, as configured in pyproject.toml.

``tools/lint_fix.sh`` applies every automatic fix and the formatting; what it cannot fix, fix by hand
(or, where a rule does not fit one line, say why in a ``# noqa: CODE - reason`` comment).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(ruff: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_finds_nothing(ruff: str) -> None:
    result = _run(ruff, "check", "--no-cache", "--output-format", "concise", "src", "tests")
    assert result.returncode == 0, f"ruff check (fix with tools/lint_fix.sh):\n{result.stdout}{result.stderr}"


def test_ruff_format_changes_nothing(ruff: str) -> None:
    result = _run(ruff, "format", "--no-cache", "--check", "src", "tests")
    assert result.returncode == 0, f"ruff format (apply with tools/lint_fix.sh):\n{result.stdout}{result.stderr}"
