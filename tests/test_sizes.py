"""Sizes that keep the code readable: no module of ``src/`` over 400 lines of code, no function over 60.

What counts is code, as the formatter writes it: each module is run through ``ruff format`` (the
project's settings, in a scratch copy, so the rule reads the same before and after
``tools/lint_fix.sh``), then every line that holds code counts once. Blank lines, comments and
docstrings (any string standing alone as a statement) do not count, so documenting costs nothing.
Squeezing gains nothing: the formatter puts each statement on its own line (``a = 1; b = 2`` is two),
the body of ``if x: return`` under its header, and a call or expression longer than the line
length (120) over as many lines as it needs, one argument a line. ``# fmt: off`` and
``# fmt: skip``, which would keep a squeezed line, are refused in ``src/``.

A function's lines run from its first decorator to its end, nested functions included. Two kinds of
function may be longer, each saying why in a comment above it or in its signature: an argparse
declaration (one list of options) and a flat loop kept flat for speed (``schedule/dataflow.py``,
``sim/compiled.py``, ``sim/rounds.py``).
"""

from __future__ import annotations

import ast
import functools
import io
import shutil
import subprocess
import tempfile
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pipeweave"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
EXCUSES = ("argparse declaration", "one flat loop, for speed")
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def _format(ruff: str, text: str) -> str:
    """``text`` as ``ruff format`` writes it under the project's settings."""
    args = [ruff, "format", "--config", str(ROOT / "pyproject.toml"), "--stdin-filename", "x.py", "-"]
    return subprocess.run(args, input=text, capture_output=True, text=True, check=True, timeout=60).stdout


@functools.cache
def _formatted_sources(ruff: str) -> dict[str, str]:
    """Every module of ``src/pipeweave`` as the formatter writes it, by its path below the package."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "pipeweave"
        shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
        args = [ruff, "format", "--quiet", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(copy)]
        subprocess.run(args, check=True, timeout=300)
        return {str(p.relative_to(copy)): p.read_text() for p in sorted(copy.rglob("*.py"))}


def code_lines(text: str) -> set[int]:
    """The numbers of the lines of ``text`` that hold code: not blank, not only a comment, not a docstring."""
    strings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            strings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    held = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in _NOT_CODE:
            held.update(range(token.start[0], token.end[0] + 1))
    return held - strings


def _functions(text: str) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, int]]:
    """Each function of ``text`` with the line it starts on (its first decorator's, if any)."""
    return [
        (node, min([d.lineno for d in node.decorator_list] + [node.lineno]))
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def test_no_module_over_400_lines(ruff: str) -> None:
    long = {
        name: n for name, text in _formatted_sources(ruff).items() if (n := len(code_lines(text))) > MAX_MODULE_LINES
    }
    assert long == {}, "split these modules by idea (lines of code, as the module docstring counts them)"


def test_no_function_over_60_lines_without_its_reason(ruff: str) -> None:
    long = []
    for name, text in _formatted_sources(ruff).items():
        lines, held = text.splitlines(), code_lines(text)
        for node, start in _functions(text):
            size = len([n for n in held if start <= n <= (node.end_lineno or node.lineno)])
            said = " ".join(lines[max(0, start - 2) : node.body[0].lineno - 1])  # the line above, the signature
            if size > MAX_FUNCTION_LINES and not any(excuse in said for excuse in EXCUSES):
                long.append(f"{name}:{node.lineno} {node.name} ({size} lines)")
    assert long == [], "split these functions (or say on the def line why one may stay long)"


def test_no_formatter_pragmas_in_src(ruff: str) -> None:
    kept = [name for name, text in _formatted_sources(ruff).items() if "fmt: off" in text or "fmt: skip" in text]
    assert kept == [], "the formatter lays out all of src/ (the size rule counts its lines)"


def test_squeezing_lines_gains_nothing(ruff: str) -> None:
    spread = '''
def f(x):
    """One.

    Two.
    """
    # a comment
    if x:
        return 1
    a = 1
    b = 2
    return g(
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
        "cccccccccccccccccccccccccccccccccccccccccccccc",
    )
'''
    squeezed = '''def f(x):
    """One. Two."""
    if x: return 1
    a = 1; b = 2
    return g("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "cccccccccccccccccccccccccccccccccccccccccccccc")
'''
    assert len(code_lines(_format(ruff, spread))) == len(code_lines(_format(ruff, squeezed))) == 10
