"""Nothing lost, nothing left behind: a run killed again and again resumes to the uninterrupted run's result.

A run of the tiny mlp saving every step (``--save-every 1 --resume auto``) is
killed at seeded random moments -- the launcher or one of its ranks, by
SIGKILL, or the launcher by SIGHUP (a closed terminal) -- and started again
with the same command each time, as torchelastic or a job scheduler would.
After every kill no process of the run is left; at the end the final
parameters equal an uninterrupted run's bitwise, the last run's losses equal
the uninterrupted run's for the same steps, and no temporary file is left in
the checkpoint or output folders.

The side outputs fail too (``pipeweave.side_output``): a full ``--log-dir``,
a full ``--out`` and a checkpoint folder made read-only in the middle of a
run each end in one line, the run trained to its end, its record written
and the exit code ``OUTPUT_FAILED``. A full disk is a file-size limit
(``RLIMIT_FSIZE``) set on the processes that write there once they run:
Python ignores the SIGXFSZ it raises, so the write fails (``File too
large``) as a full disk's does.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import resource
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
from pipeweave.side_output import OUTPUT_FAILED

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
    assert _left_in_shm(shm_before) == set()


def _left_in_shm(before: set[str]) -> set[str]:
    """The ``/dev/shm`` entries made since ``before`` that stay there for 20 s (another process on a shared
    machine makes and removes its own semaphores meanwhile; what a killed run leaked stays)."""
    left = set(os.listdir("/dev/shm")) - before
    deadline = time.monotonic() + 20
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left &= set(os.listdir("/dev/shm"))
    return left


def _quick(out: Path, *more: str) -> list[str]:
    """A run of the tiny mlp on 2 ranks (gloo: no shared-memory ring that a file-size limit would refuse)."""
    mlp = ["--model", "mlp", "--layers", "4", "--hidden", "8", "--batch", "8", "--microbatches", "2", "-s", "1f1b"]
    return [sys.executable, "-m", "pipeweave.cli", "train", *mlp, "--quiet", "--out", str(out), "--transport", "gloo",
            "--timeout", "30", *more]  # fmt: skip


def _waiting_for(found: Callable[[], object], proc: subprocess.Popen[str]) -> object:
    """Poll ``found()`` until it is something, while the run lives (at most 60 s)."""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if thing := found():
            return thing
        time.sleep(0.005)
    raise AssertionError("the run ended before the fault could be injected")


def _ranks(pid: int) -> list[int]:
    """The run's rank processes (the fork server's children) once both are there."""
    ranks = [child for child, parent in descendants(pid).items() if parent != pid]
    return ranks if len(ranks) == 2 else []


def _outcome(proc: subprocess.Popen[str]) -> list[str]:
    """The run's lines on stderr, once it ended with no traceback."""
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.strip()]


@pytest.mark.slow  # a fresh launcher and fork server: ~7 s of CPU (55-60 s at a load of 14 on 2 cores)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prlimit and /proc as on Linux")
def test_a_full_log_dir_is_one_warning_and_the_run_ends_with_its_record(tmp_path: Path) -> None:
    """The log writer's ENOSPC escaped its thread: `rank 1 failed: OSError`, two tracebacks, no record."""
    tb, out = tmp_path / "tb", tmp_path / "out"
    proc = subprocess.Popen(_quick(out, "--steps", "60", "--log-dir", str(tb)), stderr=subprocess.PIPE, text=True)
    for rank in _waiting_for(lambda: _ranks(proc.pid), proc):  # type: ignore[attr-defined]
        resource.prlimit(rank, resource.RLIMIT_FSIZE, (4096, 4096))  # a few steps' events fit, then the disk is full
    lines = _outcome(proc)
    (events,) = tb.rglob("events.out.tfevents.*")
    line = f"cannot write {events}: File too large"
    assert lines == [f"pipeweave train: warning: {line}; logging stops, the run goes on"], lines
    assert proc.returncode == OUTPUT_FAILED
    record = json.loads((out / "train.json").read_text())
    assert len(record["losses"]) == 60 and record["output_failures"] == [line]
    assert sorted(p.name for p in out.iterdir()) == ["timeline.png", "trace.json", "train.json"]


@pytest.mark.slow  # a fresh launcher and fork server: ~7 s of CPU (55-60 s at a load of 14 on 2 cores)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prlimit and /proc as on Linux")
def test_a_full_out_after_the_run_is_one_line_and_its_own_exit_code(tmp_path: Path) -> None:
    """A full `--out` exited 2, the code of a usage error, after a run that had trained."""
    out = tmp_path / "out"
    proc = subprocess.Popen(_quick(out, "--steps", "12"), stderr=subprocess.PIPE, text=True)
    _waiting_for(lambda: _ranks(proc.pid), proc)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (20_000, 20_000))  # the launcher's disk: the record fits
    lines = _outcome(proc)
    trace, plot = out / "trace.json", out / "timeline.png"
    assert lines == [f"pipeweave train: error: cannot write {trace}: File too large; nor {plot}"], lines
    assert proc.returncode == OUTPUT_FAILED
    record = json.loads((out / "train.json").read_text())
    assert len(record["losses"]) == 12
    assert record["output_failures"] == [
        f"cannot write {trace}: File too large",
        f"cannot write {plot}: File too large",
    ]
    assert sorted(p.name for p in out.iterdir()) == ["train.json"]  # no half-written file, no temporary one


def _without_overriding_permissions() -> None:
    """A root process ignores a folder's permissions; without CAP_DAC_OVERRIDE (and its reading half) it cannot."""
    if os.geteuid() == 0:
        prctl, capbset_drop = ctypes.CDLL(None, use_errno=True).prctl, 24  # PR_CAPBSET_DROP: gone at exec
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if prctl(capbset_drop, capability, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.slow  # a fresh launcher and fork server: ~7 s of CPU (55-60 s at a load of 14 on 2 cores)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="capabilities as on Linux")
def test_a_checkpoint_folder_made_read_only_mid_run_is_one_warning_and_the_run_ends_with_its_record(
    tmp_path: Path,
) -> None:
    """Every save after the folder turned read-only said a line of its own, and the run exited 1."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    argv = _quick(out, "--steps", "6", "--save", str(ck), "--save-every", "1")
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=_without_overriding_permissions)
    _waiting_for(lambda: _newest_steps(ck) >= 2, proc)
    ck.chmod(0o555)
    try:
        lines = _outcome(proc)
    finally:
        ck.chmod(0o755)
    assert proc.returncode == OUTPUT_FAILED, lines
    assert len(lines) == 1 and lines[0].startswith("pipeweave train: warning: cannot "), lines
    assert ": Permission denied; the newest checkpoint kept is " in lines[0], lines
    record = json.loads((out / "train.json").read_text())
    kept = _newest_steps(ck)
    assert len(record["losses"]) == 6 and len(record["save_failures"]) == 6 - kept
    assert record["save_failures"][0] == lines[0].removeprefix("pipeweave train: warning: ")
    assert sorted(p.name for p in out.iterdir()) == ["timeline.png", "trace.json", "train.json"]
