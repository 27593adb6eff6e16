"""Every script under ``benchmarks/`` still imports on this tree, so that a moved module breaks the suite.

Each script is loaded from its file (its ``main`` guarded by ``if __name__ ==
"__main__":``, so nothing is measured), all in this one process; and every
``pipeweave`` import it makes, also the ones deferred into a function, is
resolved name by name, since loading a script runs only its module-level
imports.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.rglob("*.py"))


def _id(path: Path) -> str:
    return path.relative_to(BENCHMARKS).as_posix()


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'")


def test_scripts_found() -> None:
    assert len(SCRIPTS) >= 20, [_id(p) for p in SCRIPTS]


@pytest.mark.parametrize("path", SCRIPTS, ids=_id)
def test_main_is_guarded(path: Path) -> None:
    """A script has the ``__main__`` guard and calls none of its own functions (``main()``) outside it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    calls = [
        node.lineno
        for node in tree.body
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id in own
    ]
    assert not calls, f"{_id(path)}: calls its own functions at module level on lines {calls}; guard them"
    if "main" in own:  # a script; a module without main is a library of its benchmark's script (soak/procs.py)
        assert any(_is_main_guard(node) for node in tree.body), f'{_id(path)} has no `if __name__ == "__main__":`'


@pytest.mark.parametrize("path", SCRIPTS, ids=_id)
def test_script_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The script's module-level code (its imports, constants, classes) runs without its ``main``."""
    name = "benchmarks_" + "_".join(path.relative_to(BENCHMARKS).with_suffix("").parts)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])  # an unguarded argparse main exits, measuring nothing
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])  # as `python path` runs it
    spec.loader.exec_module(module)


def _pipeweave_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """Every ``pipeweave`` import of ``path`` as (line, module, name or None), function bodies included."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "pipeweave"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "pipeweave":
            found += [(node.lineno, node.module or "", a.name) for a in node.names]
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=_id)
def test_deferred_imports_resolve(path: Path) -> None:
    """Each ``import pipeweave.X`` / ``from pipeweave.X import Y`` names a module and a name that exist."""
    missing = []
    for line, module_name, attribute in _pipeweave_imports(path):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            missing.append(f"line {line}: no module {module_name}")
            continue
        if attribute is not None and not hasattr(module, attribute):
            try:
                importlib.import_module(f"{module_name}.{attribute}")
            except ModuleNotFoundError:
                missing.append(f"line {line}: {module_name} has no {attribute}")
    assert not missing, f"{_id(path)}: " + "; ".join(missing)
