"""A launcher script for the failure tests: ``python failing_ranks.py MODE``.

MODE: ``raise`` (rank 1 raises), ``kill`` (rank 1 dies by SIGKILL), ``hang``
(every rank blocks until interrupted), ``train-raise`` (a real training run
whose rank 1 fails inside a backward), ``train-raise-auto`` and
``train-kill-auto`` (the same, or SIGKILL there, on train's default transport,
shared memory where available), ``train-stall`` (rank 1 stalls inside a
backward; rank 0's wait for its gradient times out after 3 s), ``flood`` (every
rank reports progress without end and the launcher stops reading it after
printing the PIDs: the ranks block writing into a full pipe), ``ctrl-c-at-start``
(``hang``, with a Ctrl-C sent to the launcher while it starts the fork server,
its group signals held back). Rank 0 blocks in a receive the failed
rank never answers, so only the launcher can end it. Prints ``PID <pid>`` per
rank and for the fork server, and exits with the launcher's exit code.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, RankFailure, launch
from pipeweave.runtime.run.prepare import prepare


def blocking(context: RankContext, mode: str) -> None:
    rank = context.process
    context.progress(os.getpid())
    if mode == "flood":
        dist.barrier()  # every PID is in the queue before the first report the launcher will not read
        while True:
            context.progress("x" * 4000)
    time.sleep(0.5)
    if rank == 1 and mode == "raise":
        raise ValueError("injected failure on rank 1")
    if rank == 1 and mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # never sent
    time.sleep(600)


def failing_training(context: RankContext, payload: tuple[TrainConfig, bool | str]) -> Any:
    rank = context.process
    config, kill = payload  # kill: False (raise), True (SIGKILL) or "stall"
    context.progress(os.getpid())
    if rank == 1:
        from pipeweave.runtime.stage.worker import StageWorker

        original = StageWorker.backward
        calls = [0]

        def backward(self: StageWorker, mb: int, grad_output: torch.Tensor | None = None) -> Any:
            calls[0] += 1
            if calls[0] == 6:  # inside the second step
                if kill == "stall":
                    time.sleep(600)
                if kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure in a backward on rank 1")
            return original(self, mb, grad_output)

        StageWorker.backward = backward  # type: ignore[method-assign]
    return run_rank(context, prepare(config))


def report(rank: int, value: Any) -> None:
    if value == "x" * 4000:  # flood: stop reading the ranks' reports
        time.sleep(600)
    if isinstance(value, int):
        print(f"PID {value}", flush=True)
        server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
        if server:
            print(f"PID {server}", flush=True)


def main(mode: str) -> int:
    try:
        if mode.startswith("train-"):
            config = TrainConfig(
                schedule="1f1b",
                num_stages=2,
                num_microbatches=4,
                batch_size=8,
                steps=50,
                model=ModelSpec(kind="mlp", layers=2, hidden=8),
            )
            options = LaunchOptions(
                transport="auto" if mode.endswith("-auto") else "gloo", timeout_s=3.0 if mode == "train-stall" else 60.0
            )
            kill = "stall" if mode == "train-stall" else "kill" in mode
            launch(failing_training, (config, kill), 2, options, on_progress=report)
        else:
            if mode == "ctrl-c-at-start":
                mode = "hang"
                start_fork_server = forkserver.ensure_running

                def interrupted_start() -> None:
                    start_fork_server()
                    os.kill(os.getpid(), signal.SIGINT)  # pending until the launcher restores its signal mask

                forkserver.ensure_running = interrupted_start
            launch(blocking, mode, 2, on_progress=report)
    except RankFailure as failure:
        return failure.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
