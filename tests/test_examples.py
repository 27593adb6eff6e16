"""Every script in ``examples/`` runs as a user runs it (a process; torchrun's for the launch script) and prints
what it says it does: a training run's loss falls, the simulated and planned figures are the library's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
COMMANDS = {
    "own_module.py": [sys.executable],
    "own_loop.py": [sys.executable],
    "torchrun_train.py": TORCHRUN,
    "hf_model.py": [sys.executable],
    "custom_schedule.py": [sys.executable],
    "plan.py": [sys.executable],
    "compare_schedules.py": [sys.executable],
}
"""Each example and how it is started."""


def _run(name: str) -> str:
    """The example's standard output; it must exit 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*COMMANDS[name], str(EXAMPLES / name)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=360
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def _falls(out: str, pattern: str) -> None:
    """``pattern`` (two groups: the first loss and the last) is printed, and the loss fell."""
    found = re.search(pattern, out)
    assert found, out
    assert float(found[2]) < float(found[1]), out


def test_every_example_is_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(COMMANDS)


def test_own_module() -> None:
    out = _run("own_module.py")
    assert "split before: blocks.2" in out
    _falls(out, r"loss (\d+\.\d+) -> (\d+\.\d+) after 12 steps")


def test_own_loop() -> None:
    out = _run("own_loop.py")
    losses = [float(x) for x in re.findall(r"step \d+ loss (\d+\.\d+) \(rank 1\)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0], out


def test_torchrun_launch_script() -> None:
    out = _run("torchrun_train.py")
    _falls(out, r"interleaved-1f1b on 2 ranks \(under torchrun\): loss (\d+\.\d+) -> (\d+\.\d+) after 6 steps")


def test_hf_model() -> None:
    pytest.importorskip("transformers")
    out = _run("hf_model.py")
    assert "layers: 3 split before: transformer.h.0, transformer.h.1" in out
    _falls(out, r"hf:gpt2 loss (\d+\.\d+) -> (\d+\.\d+) after 4 steps")


def test_custom_schedule() -> None:
    out = _run("custom_schedule.py")
    assert "rank 1 |" in out and "bubble: by hand 0.077, 1f1b 0.200" in out  # ZB-H1's 1/13 at D=2, T=4
    _falls(out, r"trained zb_by_hand.csv: loss (\d+\.\d+) -> (\d+\.\d+)")


def test_plan_cluster() -> None:
    import pipeweave

    out = _run("plan.py")
    best = pipeweave.plan("gpt-1.7b", gpus=64, global_batch=256, gpu="h100-sxm", top=3).best[0]
    assert f"TP {best.config.tp} x PP {best.config.pp} x DP {best.config.dp}" in out.splitlines()[1]
    assert len(re.findall(r"^TP \d+ x PP \d+ x DP \d+ ", out, re.M)) == 3
    assert "with 1f1b on 4 stages: step" in out


def test_compare_schedules() -> None:
    out = _run("compare_schedules.py")
    assert re.search(r"^1f1b +bubble 0\.273 +peak activations 4 M_a$", out, re.M)  # (D-1)/(T+D-1), D M_a
    assert re.search(r"^zb-h2 +bubble 0\.000", out, re.M)
    assert "searched under 1F1B's memory: bubble 0.111" in out  # ZB-H1's (D-1)/(3T+D-1) at D=4, T=8
    assert re.search(r"^pipedream-2bw +PipeDream-2BW +bubble \S+ +staleness 1$", out, re.M)
