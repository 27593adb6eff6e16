"""``schedule/``, ``sim/``, ``autoschedule/`` and ``planner/`` import no torch (DESIGN.md: only the runtime does)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pipeweave

PURE = ("schedule", "sim", "autoschedule", "planner")
ROOT = Path(pipeweave.__file__).parent

# Imports the named modules (or every module of the pure packages) and prints
# {"torch": ..., "failed": [...]}: modules whose import raised ImportError are
# retried alone, because ortools and highspy clash when loaded into one process
# (undefined HiGHS symbols), which is a fact about those wheels, not about torch.
_PROBE = """
import importlib, json, pkgutil, sys
names = {names!r}
if not names:
    for pkg in {pure!r}:
        base = importlib.import_module("pipeweave." + pkg)
        names.append(base.__name__)
        names += [m.name for m in pkgutil.walk_packages(base.__path__, prefix=base.__name__ + ".")]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        failed.append([name, str(exc)[:300]])
print(json.dumps({{"torch": "torch" in sys.modules, "failed": failed, "count": len(names)}}))
"""


def _probe(names: list[str]) -> dict[str, object]:
    pure = [p for p in PURE if (ROOT / p).is_dir()]
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(names=names, pure=pure)], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def _modules(pkg: str) -> list[Path]:
    return sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []


def test_importing_every_pure_module_leaves_torch_out() -> None:
    data = _probe([])
    assert data["torch"] is False, "importing schedule/, sim/ or autoschedule/ pulled in torch"
    assert isinstance(data["count"], int) and data["count"] >= 20
    failed = data["failed"]
    assert isinstance(failed, list)
    for name, first_error in failed:
        alone = _probe([name])
        assert alone["failed"] == [], f"{name} cannot be imported even alone: {first_error}"
        assert alone["torch"] is False, f"{name} imports torch"


_TORCH_IMPORT = re.compile(r"^\s*(import\s+torch\b|from\s+torch\b)", re.MULTILINE)


@pytest.mark.parametrize("pkg", PURE)
def test_no_torch_import_statement(pkg: str) -> None:
    offenders = [str(p.relative_to(ROOT)) for p in _modules(pkg) if _TORCH_IMPORT.search(p.read_text())]
    assert not offenders, f"torch imported in {offenders}; keep torch in runtime/"


def test_the_static_check_can_fail() -> None:
    assert _TORCH_IMPORT.search("x = 1\n    import torch.nn as nn\n")
    assert _TORCH_IMPORT.search("from torch import nn\n")
    assert not _TORCH_IMPORT.search("# torch is not imported here\nimport torchvision_like\n")


def test_the_probe_can_fail() -> None:
    assert _probe(["torch"])["torch"] is True
