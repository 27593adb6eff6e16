"""Failure behaviour: one failing rank, a killed rank or Ctrl-C ends every rank quickly and cleanly.

Each case runs ``failing_ranks.py`` as its own launcher process, as a user
would run ``pipeweave train``: the launcher must exit non-zero within 30 s of
the failure, print the cause exactly once, and leave no process behind (the
ranks and the fork server they came from). An invalid configuration is one
line on stderr, exit code 2, before any rank is started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).with_name("failing_ranks.py")
LIMIT_S = 30.0


def _start(mode: str) -> subprocess.Popen[str]:
    # A new session: Ctrl-C can then be sent to the whole group, as a terminal does.
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )


def _wait_for_ranks(proc: subprocess.Popen[str], count: int = 2) -> set[int]:
    """PIDs the launcher reports (ranks and fork server), once ``count`` ranks are up."""
    assert proc.stdout is not None
    pids: list[int] = []
    while len(pids) < 2 * count:  # each rank line is followed by the fork server's
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("PID "):
            pids.append(int(line.split()[1]))
    return set(pids)


def _finish(proc: subprocess.Popen[str], since: float) -> tuple[int, str, float]:
    try:
        _, err = proc.communicate(timeout=LIMIT_S + 30)
    except subprocess.TimeoutExpired:  # pragma: no cover - the failure under test
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, err, time.monotonic() - since


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited


def _assert_gone(pids: set[int]) -> None:
    deadline = time.monotonic() + 5  # the fork server notices its launcher's exit
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "processes left behind"


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("raise", "rank 1 failed: ValueError: injected failure on rank 1"),
        ("kill", "rank 1 was killed by SIGKILL"),
        ("train-raise", "rank 1 failed: RuntimeError: injected failure in a backward on rank 1"),
        ("train-raise-auto", "rank 1 failed: RuntimeError: injected failure in a backward on rank 1"),
        ("train-kill-auto", "rank 1 was killed by SIGKILL"),
    ],
)
def test_a_failing_rank_ends_every_rank(mode: str, cause: str) -> None:
    proc = _start(mode)
    pids = _wait_for_ranks(proc)
    code, err, elapsed = _finish(proc, time.monotonic())
    assert code == 1
    assert elapsed < LIMIT_S
    assert err.count(cause) == 1, err
    assert "Traceback" not in err
    _assert_gone(pids)


def test_a_rank_stuck_on_a_stalled_peer_shows_the_schedule_where_it_stopped() -> None:
    proc = _start("train-stall")
    pids = _wait_for_ranks(proc)
    code, err, elapsed = _finish(proc, time.monotonic())
    assert code == 1 and elapsed < LIMIT_S
    assert err.count("rank 0 failed: StuckError: rank 0 stuck at its action") == 1, err
    grid = [line for line in err.splitlines() if line.startswith("rank ") and " |" in line]
    assert len(grid) == 2, err  # the lowered schedule's two rows
    assert "[0RECV_B" in grid[0] and "[" not in grid[1], err  # rank 0 waits for rank 1's gradient
    assert "Traceback" not in err
    _assert_gone(pids)


def test_ctrl_c_ends_every_rank() -> None:
    proc = _start("hang")
    pids = _wait_for_ranks(proc)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
    code, err, elapsed = _finish(proc, time.monotonic())
    assert code == 130
    assert elapsed < LIMIT_S
    assert err.count("interrupted") == 1, err
    assert "Traceback" not in err
    _assert_gone(pids)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "mlp", "--layers", "3", "--stages", "4"], "need at least 4 layers, the model has 3"),
        (["--microbatches", "0"], "num_microbatches=0 is invalid"),
        (["-s", "chimera", "--stages", "3", "--model", "mlp", "--layers", "8"], "chimera needs an even number of stages"),
        (["-s", "1f1b", "--chunks", "3", "--model", "mlp"], "1f1b uses 1 chunk(s) per rank"),
    ],
)
def test_invalid_configuration_is_one_line_before_spawning(argv: list[str], message: str) -> None:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pipeweave.cli", "train", *argv], capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert time.monotonic() - started < 30
