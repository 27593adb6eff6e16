"""``--log-dir DIR``: every step's loss, learning rate, throughput, bubble and memory as TensorBoard event files.

One process writes, into ``DIR/<run id>/`` (the id of ``RunPlan.run_id``: a
run resumed from a checkpoint continues its run's folder, another run gets
its own, so two runs sharing ``--log-dir`` never merge): the one with the loss, i.e. the stage rank of
pipeline 0's last stage, ``tp`` coordinate 0. What it needs from the others
-- each process's share of the loss, its busy time and span of compute in the
step, its memory -- travels in one small asynchronous all-reduce per step
(a row per process, each filling its own), posted when the process ends the
step and read one step later, when it has long arrived: no process waits for
another to log, and the overlap of a step's tail with the next step's warm-up
is kept. The last step's row is read when the run ends (``close``). The
scalars are written by a thread of the writing process, so its step pays for
the row and the all-reduce only; that thread writes the event file itself
(the ``tensorboard`` package's records and protobufs), one event per step,
so that a write that fails -- a full disk, a removed folder -- fails there
and nowhere else: it is said once and logging stops, the run going on
(``side_output``; ``failure`` reaches the run's record).

The figures are those of the run's record: the loss is every rank's share
summed in rank order, as ``RunRecord.losses`` (``train --json``'s ``losses``);
the bubble is DESIGN.md's ``bubble_ratio`` of the step's compute actions
(``sim.bubble``); a step's time runs from the previous step's last end (the
first step: its first start) to its last end, as ``report.trace.step_times``.
Memory is per process: the CUDA allocator's peak in the step, or on the CPU
the process's resident set.

An asynchronous schedule logs each mini-batch of a stream when the stream
has drained (its losses are known then), its figures over that mini-batch's
own actions, which overlap their neighbours'; no learning rate (each stage
counts its own updates: ``train --json``'s ``lrs``).

Scalars, at the step of the training (0-based, the resumed steps counted):
``train/loss``, ``train/lr``, ``train/step_time_s``, ``train/samples_per_s``
(and ``train/tokens_per_s`` for a sequence model), ``train/bubble_ratio``,
``memory/rank{r}_bytes`` and ``memory/max_bytes``.
"""

from __future__ import annotations

import errno
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.prepare import RunPlan
from pipeweave.runtime.run.sizes import step_tokens
from pipeweave.runtime.stage.lr_schedule import LrSchedule
from pipeweave.schedule.ir import Op
from pipeweave.side_output import SideOutput

_COMPUTE = frozenset(op.value for op in Op if op.is_compute)  # records hold op strings
_BUSY, _START, _END, _MEMORY, _LOSS, _REPORTS = range(6)  # the columns of a process's row
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def writer_stage_rank(plan: RunPlan) -> int:
    """The stage rank with the loss: that of pipeline 0's last stage."""
    placement = plan.schedule.placement
    return placement.stage_rank[placement.pipelines[0][-1]]


class StepLog:
    """One process's part of ``--log-dir`` (a no-op without it).

    Args:
        plan: the run.
        context: this process's run context: its process, the run's processes, its device (where the
            all-reduced rows live: the GPU under NCCL), whether it reports for its stage rank.
        rates: the run's learning rates (None: a constant ``config.training.lr``; a stream logs none, its stages
            updating on their own counts).
    """

    def __init__(self, plan: RunPlan, context: RankContext, rates: LrSchedule | None) -> None:
        config, process = plan.config, context.process
        self.on = config.logging.log_dir is not None
        self.plan, self.process, self.world, self.rates = plan, process, context.world, rates
        self.device = context.device
        self.reporting = context.reporting
        self._pending: tuple[int, Any, torch.Tensor, Any] | None = None
        self._last_end: float | None = None
        self.writer: EventFile | None = None
        self.output: SideOutput | None = None
        if not self.on:
            return
        run_id = [plan.run_id]  # process 0's: under torchrun each process drew its own for a run not resumed
        dist.broadcast_object_list(run_id, src=0, device=self.device)
        if process == writer_stage_rank(plan) * config.parallel.per_stage_rank:  # dp, cp and tp coordinates 0
            folder = log_folder(config.logging.log_dir, run_id[0])
            self.output = SideOutput(folder, _warn)
            self.writer = self.output.attempt(lambda: EventFile(folder))
            if self.writer is not None:
                self.output.path = self.writer.path  # what a failure names
            self._queue: queue.SimpleQueue[tuple[int, list[list[float]]] | None] = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._write_all, name="pipeweave-log-dir", daemon=True)
            self._thread.start()

    def after_step(self, step: int, share: float, records: Sequence[tuple[int, str, int, float, float]]) -> None:
        """Step ``step`` of this run is done here: post its row, write the previous step's figures."""
        if not self.on:
            return
        compute = [r for r in records if r[1] in _COMPUTE]
        mine = [0.0, 0.0, 0.0, self._memory(), share, 1.0 if self.reporting else 0.0]
        if compute:
            mine[_BUSY] = sum(t1 - t0 for _, _, _, t0, t1 in compute)
            mine[_START], mine[_END] = compute[0][3], max(t1 for *_, t1 in compute)
        rows = torch.zeros(self.world, 6, dtype=torch.float64)
        rows[self.process] = torch.tensor(mine, dtype=torch.float64)
        rows = rows.to(self.device)
        work = dist.all_reduce(rows, async_op=True)
        done = None
        if self.device.type == "cuda":  # the host never waits on the GPU: the sum comes back behind the step's work
            work.wait()  # on the stream
            rows, done = rows.to("cpu", non_blocking=True), torch.cuda.Event()
            done.record()
        self._finish()
        self._pending = (step, work, rows, done)

    @property
    def failure(self) -> str | None:
        """Why the log stopped: the one line of its failed write (None: it is whole, or this process writes none)."""
        return self.output.failure if self.output is not None else None

    def close(self) -> None:
        """The run's steps are done: write the last step's figures and close the files."""
        if not self.on:
            return
        self._finish()
        if self.output is not None:
            self._queue.put(None)
            self._thread.join()
            if self.writer is not None:
                self.output.attempt(self.writer.close)
                if self.output.failure is not None:  # now or at an earlier write
                    self.writer.abandon()

    def _finish(self) -> None:
        if self._pending is None:
            return
        step, work, rows, done = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()  # a step ago: long done
        else:
            work.wait()
        if self.output is not None:
            self._queue.put((step, rows.tolist()))

    def _write_all(self) -> None:
        """The writer's thread: the protobufs and files of the scalars, off the training thread; after a failed
        write (``SideOutput``) it only empties its queue."""
        assert self.output is not None
        while (item := self._queue.get()) is not None:
            if self.writer is not None:
                self.output.attempt(lambda: self._write(*item))  # noqa: B023 - called at once

    def _write(self, step: int, rows: list[list[float]]) -> None:
        config = self.plan.config
        at = self.plan.steps_done + step
        mine = [row for row in rows if row[_REPORTS]]  # one process per stage rank, in rank order
        end = max(row[_END] for row in mine)
        took = end - (self._last_end if self._last_end is not None else min(row[_START] for row in mine))
        self._last_end = end
        widest = max(row[_END] - row[_START] for row in mine)
        busy = sum(row[_BUSY] for row in mine)
        scalars = {
            "train/loss": sum(row[_LOSS] for row in mine),
            "train/step_time_s": took,
            "train/bubble_ratio": 1.0 - busy / (len(mine) * widest) if widest > 0 else 0.0,
            "memory/max_bytes": max(row[_MEMORY] for row in rows),
        }
        if not config.is_stream:
            scalars["train/lr"] = self.rates.at(at) if self.rates is not None else config.training.lr
        if took > 0:
            scalars["train/samples_per_s"] = config.data.batch_size / took
            tokens = step_tokens(config, self.plan.schedule.num_microbatches, at)
            if tokens is not None:
                scalars["train/tokens_per_s"] = tokens / took
        for r, row in enumerate(mine):
            scalars[f"memory/rank{r}_bytes"] = row[_MEMORY]
        assert self.writer is not None
        self.writer.add_scalars(scalars, at)

    def _memory(self) -> float:
        """This process's memory: the CUDA allocator's peak since the last step, or the resident set on the CPU."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return float(peak)
        try:
            with open("/proc/self/statm", "rb") as f:
                return float(int(f.read().split()[1]) * _PAGE)
        except OSError:  # pragma: no cover - no /proc
            return 0.0


def log_folder(log_dir: str | os.PathLike[str], run_id: str) -> Path:
    """Where a run logs: its own folder in ``--log-dir``, named by its run id (that of the checkpoint it resumed)."""
    return Path(log_dir) / (run_id or "run")


def _warn(line: str) -> None:
    print(f"pipeweave train: warning: {line}; logging stops, the run goes on", file=sys.stderr, flush=True)


class EventFile:
    """A TensorBoard event file, written where it is called (the log thread): each step's scalars as one event.

    ``events.out.tfevents.<time>.<host>.<pid>`` in ``folder`` (created), as TensorBoard's own writers name
    theirs; each record flushed as written, so a failed write raises at the step it belongs to, and so does
    a write into a file removed meanwhile (a removed folder), which the system would accept and lose.
    """

    def __init__(self, folder: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event  # tensorboard only when asked, on this process
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = folder / f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self.file = open(self.path, "wb")  # noqa: SIM115 - closed by close() or abandon()
        self.records = RecordWriter(self.file)
        self._put(Event(wall_time=now, file_version="brain.Event:2"))

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Write ``scalars`` (tag -> value) at ``step``."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        self._put(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        self.file.close()

    def abandon(self) -> None:
        """Close the file after a failed write, dropping what it still holds (the failure was said)."""
        try:
            self.file.close()  # its buffer's flush fails again; the descriptor is closed all the same
        except OSError:
            pass

    def _put(self, event: Any) -> None:
        self.records.write(event.SerializeToString())
        self.file.flush()
        if os.fstat(self.file.fileno()).st_nlink == 0:  # its folder removed: the writes would go nowhere, unsaid
            raise FileNotFoundError(errno.ENOENT, "removed while the run wrote it", str(self.path))
