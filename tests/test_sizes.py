"""Sizes that keep the code readable: no runtime module over 400 lines, no function over 60.

Two kinds of function may be longer, each saying why in a comment on its ``def``
line or the line above: an argparse declaration (one list of options) and the
flat loop of ``schedule/dataflow.py`` (kept flat for speed).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pipeweave"
MAX_MODULE_LINES = 400  # runtime/
MAX_FUNCTION_LINES = 60
EXCUSES = ("argparse declaration", "one flat loop, for speed")


def test_no_runtime_module_over_400_lines() -> None:
    long = {str(p.relative_to(SRC)): n for p in sorted((SRC / "runtime").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, "split these modules by idea"


def test_no_function_over_60_lines_without_its_reason() -> None:
    long = []
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                said = " ".join(lines[max(0, node.lineno - 2): node.lineno])
                if size > MAX_FUNCTION_LINES and not any(excuse in said for excuse in EXCUSES):
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({size} lines)")
    assert long == [], "split these functions (or say on the def line why one may stay long)"
