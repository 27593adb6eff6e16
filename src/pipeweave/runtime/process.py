"""What a process is as a rank: its device, how it was started, its host allocator, whom it dies with.

The bottom layer of ``pipeweave.runtime``: used by the launcher
(``runtime.run.launch``) when a process becomes a rank. It holds no state:
what a rank knows of its run (wait timeout, progress sink, mesh, transport)
is its ``runtime.context.RankContext``. It imports nothing of ``pipeweave``.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time

import torch


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or any env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def device_for(rank: int) -> torch.device:
    """CPU for gloo; for NCCL the GPU of the local rank."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    return torch.device("cuda", local)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_KEEP_BYTES = 1 << 30


def keep_freed_host_memory() -> bool:
    """Make glibc's allocator keep freed memory of this process for reuse; True if it took effect.

    PyTorch's CPU tensors come from ``malloc``. Under glibc's defaults a block
    of 128 KiB or more (a microbatch's activations, a layer's gradient) is
    mapped on allocation and unmapped on free, so every microbatch touches
    fresh pages and pays a page fault per 4 KiB; freed heap memory above
    128 KiB is returned to the system too. Raising both thresholds to 1 GiB
    keeps that memory in the process for the next microbatch, as jemalloc or
    tcmalloc (PyTorch's CPU performance guide recommends them) would; see
    benchmarks/runtime/README.md for the measured effect. The cost: a rank's
    resident memory stays at its peak. No effect (False) where the C library
    is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
    except (OSError, AttributeError):  # pragma: no cover - musl or another C library
        return False


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:  # pragma: no cover - no libc: the launcher still terminates children
            pass


def die_with_process(pid: int, started: int | None, poll_s: float = 0.5) -> None:
    """Leave this process (``os._exit(1)``) as soon as process ``pid`` is gone, however it ended.

    A spawned rank's parent is the fork server, not the launcher, so
    ``die_with_parent`` cannot see a launcher killed by SIGKILL, the OOM killer
    or a scheduler: the ranks would train on, or block forever writing
    progress nobody reads. A daemon thread waits on a pidfd of ``pid``
    (``os.pidfd_open``, Linux 5.3+; readable when the process exits) or, where
    there is none, checks every ``poll_s`` that ``pid`` is alive. ``started``
    (``start_time(pid)``, taken by ``pid`` itself) tells the process from a
    later one given the same PID. The thread needs the GIL only to exit, and
    a thread blocked in a write (``os.write`` releases the GIL) does not hold it.
    """
    threading.Thread(
        target=_exit_when_gone, args=(pid, started, poll_s), name="pipeweave-die-with", daemon=True
    ).start()


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat``); None: no such process, or no /proc."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of process ``pid`` from ``/proc`` (fields 3 and 22 of proc(5)'s stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name in parentheses may hold spaces
    except OSError:
        return None
    return fields[0].decode(), int(fields[19])


def _alive(pid: int, started: int | None) -> bool:
    """Is ``pid`` the process that started at ``started``, and not yet exited (a zombie has)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: a reused PID, which the start time tells
        pass
    stat = _stat(pid)
    if stat is None:  # no /proc here (os.kill said alive), or the process just went
        return not os.path.isdir("/proc/self")
    return stat[0] not in ("Z", "X") and started in (None, stat[1])


def _exit_when_gone(pid: int, started: int | None, poll_s: float) -> None:
    try:
        fd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux 5.3+ (polled below), or already gone (_alive says so)
        fd = None
    if fd is not None and _alive(pid, started):  # checked after opening: the pidfd names this very process
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
    else:
        while _alive(pid, started):
            time.sleep(poll_s)
    os._exit(1)
