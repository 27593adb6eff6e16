"""No process-wide mutable state in ``pipeweave.runtime``: a rank's state travels in its ``RankContext``.

An AST scan of every module under ``src/pipeweave/runtime``. The rule:

1. No ``global`` statement anywhere (nor ``nonlocal`` reaching a module's names: Python has none).
2. A name bound at a module's top level is bound once: no second top-level assignment, augmented
   assignment or ``del`` of it, and no assignment to it from a function (which would need ``global``).
3. A top-level name bound to a mutable value -- a list, dict or set display or comprehension, or a call of
   ``list``, ``dict``, ``set``, ``bytearray``, ``deque``, ``defaultdict``, ``OrderedDict``, ``Counter`` --
   is a constant table: nothing in the module stores into it (``NAME[k] = ...``, ``del NAME[k]``,
   ``NAME.attr = ...``, ``NAME += ...``) or calls a mutating method on it (``append``, ``update``, ...).
4. A class body binds no mutable value (it would be shared by every instance, every rank of the process);
   a dataclass field's ``field(default_factory=...)`` makes one per instance.

What stays allowed, being immutable or pure: constants, type aliases, tuples and frozensets, frozen
dataclass instances, loggers, functions and classes, and ``functools.cache``-style memoisation of a pure
function (its cache only saves recomputing the same value). What a process must change for a while (a patch
of torch's ``UntypedStorage.resize_`` by ``stage.tensor_bytes``) is a context manager that puts it back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "src" / "pipeweave" / "runtime"
MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "deque", "defaultdict", "OrderedDict", "Counter"}
MUTATING_METHODS = {
    "append",
    "extend",
    "insert",
    "remove",
    "pop",
    "popitem",
    "clear",
    "update",
    "setdefault",
    "add",
    "discard",
    "appendleft",
    "extendleft",
    "__setitem__",
    "__delitem__",
    "sort",
    "reverse",
}


def _is_mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in MUTABLE_CALLS
    return False


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _names(t)]
    return []


def _root(node: ast.expr) -> str | None:
    """``NAME`` of ``NAME[...]``, ``NAME.attr``, ``NAME[...].attr[...]``."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """The module's own statements, those inside top-level ``if``/``try`` blocks included."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo[:0] = [*node.body, *node.orelse, *getattr(node, "handlers", []), *getattr(node, "finalbody", [])]
        elif isinstance(node, ast.ExceptHandler):
            todo[:0] = node.body
    return out


def violations(source: str, where: str) -> list[str]:
    """Every breach of the rule (module docstring) in one module's ``source``."""
    tree = ast.parse(source)
    found = [f"{where}:{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    bound: dict[str, int] = {}
    mutable: set[str] = set()
    for node in _top_level(tree):
        if isinstance(node, ast.Delete):
            found += [f"{where}:{node.lineno}: del {n}" for t in node.targets for n in _names(t)]
        for target in _targets(node):
            for name in _names(target):
                if isinstance(node, ast.AugAssign) or name in bound:
                    found.append(f"{where}:{node.lineno}: {name} bound again at module level")
                bound.setdefault(name, node.lineno)
                if _is_mutable(getattr(node, "value", None)):
                    mutable.add(name)
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        found += [
            f"{where}:{n.lineno}: {cls.name}.{', '.join(ast.unparse(t) for t in _targets(n))} shared by its instances"
            for n in cls.body
            if _is_mutable(getattr(n, "value", None))
        ]
    for node in ast.walk(tree):
        for target in [*_targets(node), *(node.targets if isinstance(node, ast.Delete) else [])]:
            if isinstance(target, (ast.Subscript, ast.Attribute)) and _root(target) in mutable:
                found.append(f"{where}:{node.lineno}: module-level {_root(target)} mutated")
            if isinstance(node, ast.AugAssign) and _root(target) in mutable:
                found.append(f"{where}:{node.lineno}: module-level {_root(target)} mutated")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATING_METHODS
            and _root(node.func.value) in mutable
        ):
            found.append(f"{where}:{node.lineno}: module-level {_root(node.func.value)}.{node.func.attr}(...)")
    return found


def test_no_module_level_mutable_state_in_the_runtime() -> None:
    found = [
        v
        for path in sorted(RUNTIME.rglob("*.py"))
        for v in violations(path.read_text(), str(path.relative_to(RUNTIME.parents[1])))
    ]
    assert found == [], "pass run state in the RankContext (runtime/context.py), not through modules:\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "source",
    [
        "_active = None\ndef install(m):\n    global _active\n    _active = m\n",
        "_x = 1\n_x = 2\n",
        "_seen = []\ndef f(v):\n    _seen.append(v)\n",
        "_by_name = {}\ndef f(k, v):\n    _by_name[k] = v\n",
        "_counts = dict()\ndef f(k):\n    _counts[k] += 1\n",
        "_state = {'a': []}\ndef f():\n    _state['a'].append(1)\n",
        "n = 0\nn += 1\n",
        "class Registry:\n    seen = []\n",
    ],
)
def test_the_scan_finds_state(source: str) -> None:
    assert violations(source, "m.py")


@pytest.mark.parametrize(
    "source",
    [
        "LIMIT = 3\nNAMES = ('a', 'b')\nTABLE = {'a': 1}\ndef f(k):\n    return TABLE[k]\n",
        "import functools\n@functools.cache\ndef f(n):\n    return n * 2\n",
        "import logging\nlog = logging.getLogger(__name__)\n",
        "def f():\n    seen = []\n    seen.append(1)\n    return seen\n",
        "try:\n    import fast\nexcept ImportError:\n    fast = None\n",
        "@dataclass\nclass Record:\n    losses: list[float] = field(default_factory=list)\n",
    ],
)
def test_the_scan_allows_constants(source: str) -> None:
    assert violations(source, "m.py") == []
