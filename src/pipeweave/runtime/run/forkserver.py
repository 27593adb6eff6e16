"""The fork server the spawned ranks come from, and multiprocessing's resource tracker beside it.

A fresh server process imports torch once per launcher process and forks
every rank from it: forking the launcher itself could inherit its OpenMP
threads, spawning would re-import torch in every rank (seconds each on a busy
machine). Here: its context, its start with the terminal's group signals held
back, its end when a run is stopped while its ranks were starting, and its
quick exit when its launcher goes (``forkserver_exit``).
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
from typing import Any

import torch.multiprocessing as mp

# What a terminal sends its whole foreground process group: the launcher acts on them, its helpers do not.
GROUP_SIGNALS = {signal.SIGINT, signal.SIGHUP}


def context() -> Any:
    """The forkserver context, its server preloading torch and the rank's code."""
    ctx = mp.get_context("forkserver")
    # torch.optim imports torch._dynamo on first use: seconds per rank unless preloaded; so does a checkpoint
    # torch.distributed.checkpoint (0.7 s: it imports DTensor), which the launcher itself never needs.
    # Last: the server then leaves at once when its launcher goes, without finalizing torch (``forkserver_exit``).
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "torch._dynamo",
            "torch.distributed.checkpoint",
            "pipeweave.runtime.run.job",
            "pipeweave.runtime.run.forkserver_exit",
        ]
    )
    return ctx


def start_helpers() -> None:
    """Start the fork server and multiprocessing's resource tracker with SIGINT and SIGHUP blocked.

    A terminal sends Ctrl-C and its hangup to the whole process group. The
    fork server imports torch for seconds before it ignores SIGINT: a Ctrl-C
    then printed its traceback beside the launcher's one line; a hangup killed
    it and the tracker, which the launcher then missed at its exit (more
    tracebacks). Blocked (the mask is inherited across their exec) the signals
    wait in them, harmless (the ranks unblock them in ``launch._child``); in the
    launcher they wait only until unblocked here, lost to neither: its caller
    must be ready for KeyboardInterrupt as this returns.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        multiprocessing.resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)  # starting the tracker unblocked SIGINT
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_fork_server() -> None:
    """Kill the fork server, which would still fork a rank whose start was interrupted.

    That rank would start after the launcher's exit, find its queue's lock
    gone and print a traceback. The next ``launch`` starts a fresh server.
    """
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            server._stop()  # closes its end, reaps it, forgets it
        except OSError:  # pragma: no cover - gone already
            pass
