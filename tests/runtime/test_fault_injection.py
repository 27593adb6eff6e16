"""Nothing lost, nothing left behind: a run killed again and again resumes to the uninterrupted run's result.

A run of the tiny mlp saving every step (``--save-every 1 --resume auto``) is
killed at seeded random moments -- the launcher or one of its ranks, by
SIGKILL, or the launcher by SIGHUP (a closed terminal) -- and started again
with the same command each time, as torchelastic or a job scheduler would.
After every kill no process of the run is left; at the end the final
parameters equal an uninterrupted run's bitwise, the last run's losses equal
the uninterrupted run's for the same steps, and no temporary file is left in
the checkpoint or output folders.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from processes import descendants

from pipeweave.runtime.run import checkpoint_files

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

STEPS = 60
KILLS = 10


def _command(save: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeweave.cli",
        "train",
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        "32",
        "--batch",
        "16",
        "--microbatches",
        "4",
        "-s",
        "1f1b",
        "--steps",
        str(STEPS),
        "--save",
        str(save),
        "--save-every",
        "1",
        "--resume",
        "auto",
        "--quiet",
        "--out",
        str(out),
        "--timeout",
        "10",
    ]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _newest_steps(save: Path) -> int:
    newest = checkpoint_files.newest(save)
    return 0 if newest is None else newest.steps


def _as_a_terminal_starts_it() -> None:
    """SIGHUP at its default, as a terminal's job has it (a suite under ``nohup`` ignores it; so would the run)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _kill_once(save: Path, out: Path, rng: random.Random, how: str) -> None:
    """Start the run, let it make at least one more checkpoint, kill it at a random moment, check nothing is left."""
    before = _newest_steps(save)
    proc = subprocess.Popen(
        _command(save, out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_as_a_terminal_starts_it,
    )
    target, deadline = before + rng.randint(1, 3), time.monotonic() + 90
    while _newest_steps(save) < target and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.02))  # anywhere in the next step, its save included
    seen = descendants(proc.pid)
    ranks = sorted(child for child, parent in seen.items() if parent != proc.pid)  # the fork server's children
    if proc.poll() is None:
        if how == "rank" and ranks:
            os.kill(rng.choice(ranks), signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGHUP if how == "hup" else signal.SIGKILL)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # pragma: no cover - the failure under test
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    left = time.monotonic() + 10
    while any(_alive(p) for p in seen) and time.monotonic() < left:
        time.sleep(0.1)
    assert not [p for p in seen if _alive(p)], f"processes left behind after a {how} kill"


def _final(save: Path, read: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    newest = checkpoint_files.newest(save)
    assert newest is not None and newest.steps == STEPS
    return {key: value for key, value in read(newest.folder).items() if key.startswith("parameters/")}


def _temporary(*folders: Path) -> list[str]:
    return [str(p) for folder in folders for p in folder.rglob("*") if ".tmp" in p.name]


# One run, its kills taking turns: the launcher by SIGKILL, a rank by SIGKILL, the launcher by SIGHUP (a closed
# ssh terminal), each at a seeded random moment; the suite pays for one run of the test, not one per signal.
KINDS = ("launcher", "rank", "hup")


@pytest.mark.slow  # 70-75 s: in the whole suite (.ci/run), out of the README's quick selection
def test_a_run_killed_ten_times_resumes_to_the_uninterrupted_result(
    tmp_path: Path, checkpoint_tensors: Callable[[Path], dict[str, torch.Tensor]]
) -> None:
    kinds = KINDS
    shm_before = set(os.listdir("/dev/shm"))
    straight = subprocess.run(
        _command(tmp_path / "straight", tmp_path / "straight-out"), capture_output=True, text=True, timeout=300
    )
    assert straight.returncode == 0, straight.stderr
    expected = json.loads((tmp_path / "straight-out" / "train.json").read_text())["losses"]
    rng = random.Random(f"fault injection {kinds}")
    save, out = tmp_path / "ck", tmp_path / "out"
    done = []
    for k in range(KILLS):
        if _newest_steps(save) >= STEPS - 2:  # keep the last steps for the run that completes
            break
        _kill_once(save, out, rng, kinds[k % len(kinds)])
        done.append(kinds[k % len(kinds)])
    assert 0 < _newest_steps(save) < STEPS, "the kills must land inside the run"
    assert set(done) == set(kinds), done  # every kind of kill happened
    last = subprocess.run(_command(save, out), capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr
    record = json.loads((out / "train.json").read_text())
    first = record["first_step"]
    assert first > 0 and record["losses"] == expected[first:]
    straight_params, params = _final(tmp_path / "straight", checkpoint_tensors), _final(save, checkpoint_tensors)
    assert straight_params.keys() == params.keys()
    assert all(torch.equal(straight_params[k], params[k]) for k in params)
    assert _temporary(save, out) == []
    assert set(os.listdir("/dev/shm")) - shm_before == set()
