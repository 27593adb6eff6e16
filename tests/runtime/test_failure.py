"""Failure behaviour: a failing or killed rank, Ctrl-C or a signal to the launcher ends every rank quickly and cleanly.

Each case runs ``failing_ranks.py`` as its own launcher process, as a user
would run ``pipeweave train``: the launcher must exit non-zero within 30 s of
the failure, print the cause exactly once, and leave no process behind (the
ranks and the fork server they came from) -- also when the launcher itself is
killed and can stop nothing. An invalid configuration is one line on stderr,
exit code 2, before any rank is started.
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
    # A new session: Ctrl-C can then be sent to the whole group, as a terminal does. SIGINT as a terminal's
    # foreground job has it: a suite started in the background (``pytest &`` in a script) ignores SIGINT, which
    # the launcher would inherit and keep (Python leaves an ignored SIGINT ignored).
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_signals_at_default,
    )


def _signals_at_default() -> None:
    # SIGHUP too: under ``nohup`` the suite ignores it, and the launcher would keep it ignored (as it should there).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


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


def _assert_gone(pids: set[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s  # the fork server notices its launcher's exit
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:  # not to leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, "processes left behind"


def _fork_server_of(launcher: int) -> int:
    """The PID of ``launcher``'s fork server, as soon as it is started (it then imports torch for seconds)."""
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == launcher and b"forkserver" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except (ValueError, OSError):  # not a process, or gone
                continue
        time.sleep(0.01)
    raise AssertionError("no fork server started")


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("raise", "rank 1 failed: ValueError: injected failure on rank 1"),
        # slow: a kill and the shared-memory transport are in the default run by "train-kill-auto"
        pytest.param("kill", "rank 1 was killed by SIGKILL", marks=pytest.mark.slow),
        ("train-raise", "rank 1 failed: RuntimeError: injected failure in a backward on rank 1"),
        pytest.param(
            "train-raise-auto",
            "rank 1 failed: RuntimeError: injected failure in a backward on rank 1",
            marks=pytest.mark.slow,
        ),
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


def test_ctrl_c_while_the_fork_server_imports_torch_is_one_line() -> None:
    proc = _start("hang")
    server = _fork_server_of(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    code, err, elapsed = _finish(proc, time.monotonic())
    assert code == 130 and elapsed < LIMIT_S
    assert err == "pipeweave: interrupted (Ctrl-C); every rank was stopped\n", err  # no traceback of the server's
    _assert_gone({server})


def test_ctrl_c_held_back_while_the_fork_server_starts_is_one_line() -> None:
    # The race above, made certain: the Ctrl-C is pending as the launcher unblocks it (a traceback until fixed).
    proc = _start("ctrl-c-at-start")
    code, err, elapsed = _finish(proc, time.monotonic())
    assert code == 130 and elapsed < LIMIT_S
    assert err == "pipeweave: interrupted (Ctrl-C); every rank was stopped\n", err


@pytest.mark.parametrize(
    ("sig", "group", "cause"),
    [
        (signal.SIGTERM, False, "terminated (SIGTERM)"),  # ``kill``, a scheduler
        # slow: SIGHUP's name is in the default run by the process-group case below
        pytest.param(signal.SIGHUP, False, "hung up (SIGHUP)", marks=pytest.mark.slow),  # a closed ssh session
        (signal.SIGHUP, True, "hung up (SIGHUP)"),  # a closed terminal: its whole foreground process group
    ],
)
def test_sigterm_and_sighup_to_the_launcher_stop_every_rank_and_are_named(
    sig: signal.Signals, group: bool, cause: str
) -> None:
    proc = _start("hang")
    pids = _wait_for_ranks(proc)
    if group:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    code, err, elapsed = _finish(proc, time.monotonic())
    assert code == 128 + sig and elapsed < LIMIT_S
    assert err == f"pipeweave: {cause}; every rank was stopped\n", err
    _assert_gone(pids)


@pytest.mark.parametrize("mode", ["hang", "flood"])
def test_the_ranks_and_the_fork_server_die_with_a_killed_launcher(mode: str) -> None:
    # SIGKILL, as the OOM killer or a job scheduler sends it: the launcher stops nothing, the ranks see it go.
    # flood: they are blocked writing progress into a pipe the launcher no longer reads.
    proc = _start(mode)
    pids = _wait_for_ranks(proc)
    time.sleep(1.0)  # flood: the pipe fills up
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    _assert_gone(pids, within_s=10.0)  # the ranks go at once; the fork server then exits its interpreter
    proc.communicate(timeout=10)


@pytest.mark.parametrize("case", ["polled", "reused-pid"])
def test_a_process_dies_with_the_one_it_watches(case: str) -> None:
    # The pidfd path is what a rank takes (above); here the polled one, on a zombie, and a PID taken by another.
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = "start_time(pid)" if case == "polled" else "start_time(pid) + 1"
    code = (
        f"import os, time\ndel os.pidfd_open\nfrom pipeweave.runtime.process import die_with_process, start_time\n"
        f"print('watching', flush=True)\npid = {target.pid}\ndie_with_process(pid, {started}, poll_s=0.1)\n"
        "time.sleep(60)\n"
    )
    watcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline() == "watching\n"
        if case == "polled":
            time.sleep(0.5)
            assert watcher.poll() is None  # the watched process is alive: so is the watcher
            target.kill()  # not reaped: a zombie is gone too
        assert watcher.wait(timeout=30) == 1
    finally:
        target.kill()
        watcher.kill()
        target.wait()


INVALID = [
    (["--model", "mlp", "--layers", "3", "--stages", "4"], "need at least 4 layers, the model has 3"),
    (["--microbatches", "0"], "num_microbatches=0 is invalid"),
    (["-s", "chimera", "--stages", "3", "--model", "mlp", "--layers", "8"], "chimera needs an even number of stages"),
    (["-s", "1f1b", "--chunks", "3", "--model", "mlp"], "1f1b uses 1 chunk(s) per rank"),
]


def test_invalid_configuration_is_one_line_before_spawning() -> None:
    # The command as a user runs it: one line on stderr, exit code 2, nothing spawned (the others in-process below).
    argv, message = INVALID[0]
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pipeweave.cli", "train", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(("argv", "message"), INVALID[1:])
def test_each_invalid_configuration_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeweave.cli import main

    assert main(["train", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and message in lines[0], captured.err
