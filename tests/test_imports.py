"""The import structure of ``src/pipeweave``: no circles, no hidden runtime imports, the runtime's layers kept.

DESIGN.md's rule: imports go downward. Every module is parsed (not
imported) and every import statement counted, at module level, under
``if TYPE_CHECKING:`` and inside functions alike, so that a circle cannot
hide behind a deferred import. The rules are data, below.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "pipeweave"

# The runtime's layers, lowest first (runtime/__init__.py says what each owns).
# A module may import runtime modules of its own layer or lower ones, never higher.
RUNTIME_LAYERS: dict[str, int] = {
    "process": 0,
    "transport": 1,
    "context": 1,
    "stage": 2,
    "executor": 3,
    "walk": 3,
    "reference": 3,
    "plain": 3,
    "profile": 3,
    "stream": 3,
    "nonfinite": 3,
    "replicas": 3,
    "zero": 3,
    "fsdp": 3,
    "clip": 3,
    "loss_scale": 3,
    "run": 4,
    "report": 5,
}
# Who may import the runtime at all: the runtime itself, the command line, and ``pipeweave.pipeline``'s
# module (a split balanced by the profiler), and ``pipeweave.train``'s (``pipeweave.training``).
MAY_IMPORT_RUNTIME = (
    "pipeweave.runtime",
    "pipeweave.commands",
    "pipeweave.cli",
    "pipeweave.pipelining",
    "pipeweave.training",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = SRC / PACKAGE) -> dict[str, Path]:
    return {module_name(p): p for p in sorted(root.rglob("*.py"))}


class Import:
    """One import statement's target module, where it is, and whether it sits inside a function."""

    def __init__(self, target: str, line: int, in_function: bool) -> None:
        self.target, self.line, self.in_function = target, line, in_function


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[Import]:
    """Every ``pipeweave`` module ``name`` imports (``from a import b`` counts ``a.b`` where it is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        yield Import(alias.name, child.lineno, inside)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] != PACKAGE:
                    continue
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    yield Import(full if full in known else base, child.lineno, inside)
            yield from walk(child, inside)

    yield from walk(tree, False)


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, Import]]]]:
    """``module -> modules it imports``, and every import per importing module with its details."""
    found = modules()
    known = set(found)
    graph: dict[str, set[str]] = {m: set() for m in known}
    details: dict[str, list[tuple[str, Import]]] = {m: [] for m in known}
    for name, path in found.items():
        for imp in imports_of(name, path, known):
            target = imp.target
            while target not in known and "." in target:  # an attribute of a module
                target = target.rpartition(".")[0]
            if target in known and target != name:
                graph[name].add(target)
                details[name].append((target, imp))
    return graph, details


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def runtime_layer(module: str) -> int | None:
    """The layer of a ``pipeweave.runtime`` module (None: not in the runtime, or the package itself)."""
    parts = module.split(".")
    if parts[:2] != [PACKAGE, "runtime"] or len(parts) < 3:
        return None
    return RUNTIME_LAYERS[parts[2]]


def test_no_import_circles() -> None:
    graph, _ = import_graph()
    assert circles(graph) == [], "import circles among these modules; make the imports go one way"


def test_no_function_level_import_of_the_runtime() -> None:
    _, details = import_graph()
    hidden = [
        f"{m}:{imp.line} imports {t}"
        for m, found in details.items()
        for t, imp in found
        if imp.in_function and t.startswith(f"{PACKAGE}.runtime")
    ]
    assert hidden == [], "import the runtime at module level, where the structure shows"


def test_every_runtime_module_has_a_layer() -> None:
    runtime = [m for m in modules() if m.startswith(f"{PACKAGE}.runtime.")]
    unknown = sorted({m.split(".")[2] for m in runtime} - set(RUNTIME_LAYERS))
    assert runtime and unknown == [], f"give {unknown} a layer in RUNTIME_LAYERS (and in runtime/__init__.py)"


def test_the_runtime_imports_only_downward() -> None:
    _, details = import_graph()
    upward = []
    for m, found in details.items():
        here = runtime_layer(m)
        for t, imp in found:
            there = runtime_layer(t)
            if there is not None and (here is None and not m.startswith(MAY_IMPORT_RUNTIME)):
                upward.append(f"{m}:{imp.line} imports {t}: only {', '.join(MAY_IMPORT_RUNTIME)} use the runtime")
            elif there is not None and here is not None and there > here:
                upward.append(f"{m}:{imp.line} (layer {here}) imports {t} (layer {there})")
    assert upward == []


# ---- the checks themselves, on made-up trees ------------------------------------------
def _graph_of(root: Path, files: dict[str, str]) -> dict[str, set[str]]:
    """The import graph of a made-up ``pipeweave`` package under ``root``."""
    for rel, text in files.items():
        path = root / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    names = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted((root / PACKAGE).rglob("*.py"))
    }
    return {name: {i.target for i in imports_of(name, path, set(names))} - {name} for name, path in names.items()}


@pytest.mark.parametrize("deferred", ["", "def f():\n    ", "if TYPE_CHECKING:\n    "])
def test_a_circle_is_found_however_it_is_hidden(tmp_path: Path, deferred: str) -> None:
    graph = _graph_of(
        tmp_path,
        {"__init__.py": "", "a.py": "from pipeweave.b import x\n", "b.py": f"{deferred}from pipeweave import a\n"},
    )
    assert circles(graph) == [["pipeweave.a", "pipeweave.b"]]


def test_a_chain_is_no_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
