"""benchmarks/gpu/check.sh: its dry run (CPU, tiny sizes) goes end to end without the solvers, so it cannot rot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu" / "check.py"
BLOCKER = """
import importlib.abc, sys
class _NoSolvers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ortools", "highspy"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU machine has no solvers)")
        return None
sys.meta_path.insert(0, _NoSolvers())
"""


def _check_module():
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def test_relative_difference_and_table(tmp_path: Path) -> None:
    check = _check_module()
    assert check.relative_difference([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert check.relative_difference([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert check.relative_difference([1.0], [1.0, 2.0]) == float("inf")
    rows = [check.Row("exact/1f1b", "0", "<= 1e-05", "pass"), check.Row("overhead", "2.0", "<= 1.05", "FAIL")]
    env = {"date": "d", "device": "cpu", "torch": "t", "commit": "c", "solvers": {"ortools": False}}
    check.write(tmp_path, rows, env, 1.0)
    table = (tmp_path / "results.md").read_text().splitlines()
    assert table[2:] == [
        "| case | measured | expected | result |",
        "|---|---|---|---|",
        "| exact/1f1b | 0 | <= 1e-05 | pass |",
        "| overhead | 2.0 | <= 1.05 | FAIL |",
    ]
    assert "ortools absent" in table[0]
    assert json.loads((tmp_path / "results.json").read_text())["rows"][1]["result"] == "FAIL"


def test_refuses_without_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    check = _check_module()
    if check.torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert check.main(["--out", str(tmp_path)]) == 2
    assert "give --dry-run" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # 1-3 min on two shared cores: a dozen short runs on spawned ranks, one compiled
def test_dry_run_end_to_end_without_solvers(tmp_path: Path) -> None:
    check = _check_module()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh"), "--dry-run", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["solvers"] == {"ortools": False, "highspy": False}
    rows = {row["case"]: row for row in result["rows"]}
    exact = [case for case in rows if case.startswith("exact/") and not rows[case]["result"].startswith("skipped")]
    assert len(exact) >= len(check.EXACT_CASES) and all(rows[case]["result"] == "pass" for case in exact)
    assert "exact/1f1b, 2 ranks sharing the GPU" in exact and "exact/zb-h1 --compile" in exact
    fp16 = [case for case in rows if "fp16" in case]  # run where --precision fp16 exists, else skipped saying so
    assert len(fp16) == 1 and (rows[fp16[0]]["result"] == "pass") == check.fp16_available()
    planned = {f"planner/{kind}/h64/{op}" for kind in ("gpt", "llama") for op in "FIW"}
    assert planned | {"overhead/one-stage"} <= set(rows)
    shared = [case for case in rows if case.startswith(("bubble/", "memory/"))]
    assert len(shared) == 2 and "(host clock)" in rows[shared[0]]["measured"]  # the dry run's timer: the CPU's
    assert not any(row["result"].startswith("skipped") for case, row in rows.items() if case not in fp16)
    assert rows["p2p/streams"]["result"] == "pass", rows["p2p/streams"]  # the transport's CUDA branches, on CPU
    assert "| exact/zb-h1 --recompute selective |" in (out / "results.md").read_text()
