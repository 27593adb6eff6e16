"""A stage's worker is built by ordered steps and sealed: nothing assigns to it from outside its construction.

Two guards. At run time, a built ``StageWorker`` refuses to set any public attribute (``stage.build.Sealed``).
In the source, an AST scan of ``src/pipeweave`` finds every assignment ``X.name = ...`` (``=``, ``+=``, an
annotated one, or ``setattr(X, "name", ...)``) where ``name`` is one of the worker's public attributes and
``X`` is a worker: a variable named ``worker``, ``w`` or ``*_worker``, or an item of ``workers`` /
``self.workers``. Outside ``runtime/stage/worker.py`` (the worker's own methods, on ``self``) there must be none:
what a stage is made of is given to its build (``runtime.stage.build``, ``runtime.run.workers``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from pipeweave.models import ModelSpec
from pipeweave.runtime.stage.build import STEPS, Stage, build_stage, stage_options
from pipeweave.runtime.stage.worker import StageWorker

SRC = Path(__file__).resolve().parents[2] / "src" / "pipeweave"
WORKER = SRC / "runtime" / "stage" / "worker.py"
WORKER_NAME = re.compile(r"^(w|worker|\w+_worker)$")


def public_attributes() -> set[str]:
    """The names a ``StageWorker`` holds: what its methods set on ``self`` and its properties, public ones."""
    tree = ast.parse(WORKER.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StageWorker"]
    names = {
        t.attr
        for n in ast.walk(cls)
        for t in _targets(n)
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    names |= {
        n.name
        for n in cls.body
        if isinstance(n, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)
    }
    names |= {"combine_grads"}  # what the worker's U ran before it was given ``combine``: no one may set it back
    return {n for n in names if not n.startswith("_")}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _is_worker(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return bool(WORKER_NAME.match(node.id))
    if isinstance(node, ast.Subscript):
        held = node.value
        return (isinstance(held, ast.Name) and held.id == "workers") or (
            isinstance(held, ast.Attribute) and held.attr == "workers"
        )
    return False


def worker_assignments(source: str, where: str, names: set[str]) -> list[str]:
    """Every assignment to a worker's attribute in ``source`` (module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and t.attr in names and _is_worker(t.value):
                found.append(f"{where}:{node.lineno}: {ast.unparse(t)} = ...")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
            and _is_worker(node.args[0])
        ):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_assigns_to_a_built_worker() -> None:
    names = public_attributes()
    assert {"optimizer", "shards", "stashing", "meter", "track_memory", "steps_done"} <= names
    found = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        if path != WORKER
        for hit in worker_assignments(path.read_text(), str(path.relative_to(SRC)), names)
    ]
    assert found == [], "give these to the stage's build (runtime.stage.build, runtime.run.workers):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "source",
    [
        "worker.optimizer = ZeroOptimizer(...)",
        "workers[s].combine_grads = self._combine",
        "self.workers[a.stage].stashing = True",
        "for w in workers.values():\n    w.steps_done = done",
        "w.track_memory = False",
        "stage_worker.shards = part",
        "setattr(worker, 'meter', meter)",
    ],
)
def test_the_scan_finds_patches(source: str) -> None:
    assert worker_assignments(source, "m.py", public_attributes())


@pytest.mark.parametrize(
    "source",
    [
        "self.optimizer = optimizer",
        "stage.optimizer = factory(params)",  # a stage under construction (stage.build.Stage)
        "workers[s].optimizer.step = step",  # the optimizer's attribute, not the worker's
        "args.precision = 'fp32'",
    ],
)
def test_the_scan_leaves_construction_alone(source: str) -> None:
    assert worker_assignments(source, "m.py", public_attributes()) == []


def test_a_built_worker_refuses_to_be_patched() -> None:
    worker = StageWorker(ModelSpec(kind="mlp", layers=2, hidden=4), range(2), batch_size=2)
    for name, value in [("optimizer", None), ("combine_grads", print), ("stashing", True), ("steps_done", 3)]:
        with pytest.raises(AttributeError, match=f"StageWorker.{name} is fixed once the stage is built"):
            setattr(worker, name, value)
    worker.start_at(3)  # what changes as it runs, it changes itself
    worker.track_memory_from_now(False)
    assert (worker.steps_done, worker.track_memory) == (3, False)


def test_a_stage_is_built_by_its_steps_in_order() -> None:
    spec = ModelSpec(kind="gpt", layers=2, hidden=8, heads=2, seq_len=4)
    options = stage_options(spec, range(1, 2), batch_size=2, recompute="selective", compress=True)
    seen: list[str] = []
    steps = [lambda stage, o, step=step: (seen.append(step.__name__), step(stage, o)) for step in STEPS]
    stage = build_stage(options, steps)
    assert seen == [
        "split_layers",
        "apply_tensor_parallel",
        "apply_context_parallel",
        "apply_expert_parallel",
        "apply_recompute",
        "place",
        "apply_compile",
        "apply_memory_levers",
        "apply_optimizer",
    ]
    assert isinstance(stage, Stage) and stage.compress and list(stage.module) == ["1"]
    worker = StageWorker.from_stage(stage)
    built = StageWorker(spec, range(1, 2), batch_size=2, recompute="selective", compress=True)
    for (name, a), b in zip(worker.named_parameters().items(), built.named_parameters().values()):
        assert torch.equal(a, b), name  # the same layers, from the model's seed
    assert worker.optimizer is stage.optimizer and worker.module is stage.module
