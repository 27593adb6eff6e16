"""``transport.timing``: the host clock on the CPU; on CUDA, events resolved once a step (tested with fake events)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.commands.train_report import _cuda_peaks
from pipeweave.models import ModelSpec
from pipeweave.runtime.executor import Executor
from pipeweave.runtime.report.trace import device_figures
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.record import RankRecord
from pipeweave.runtime.run.workers import build_workers
from pipeweave.runtime.transport.timing import CudaEventTimer, HostTimer, action_timer
from pipeweave.schedule import lower


class FakeEvent:
    """A CUDA event whose device time (ns) the test sets: ``elapsed_time`` in ms, as torch's."""

    clock: list[int] = [0]  # the fake device's time of the next recorded event

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: int | None = None

    def record(self, stream: Any = None) -> None:
        self.at = FakeEvent.clock[0]

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) / 1e6


def _timer(peaks: list[int]) -> CudaEventTimer:
    return CudaEventTimer(
        torch.device("cuda", 0),
        event=FakeEvent,
        synchronize=lambda: None,
        memory=(lambda: peaks.clear(), lambda: 300, lambda: 512),
    )


def test_the_timer_is_chosen_by_device() -> None:
    assert isinstance(action_timer(torch.device("cpu")), HostTimer)
    assert isinstance(action_timer(torch.device("cuda", 0)), CudaEventTimer)  # nothing touches the GPU yet


def test_host_timer_marks_are_the_host_clock() -> None:
    timer = HostTimer()
    timer.begin_step()
    before = time.perf_counter_ns()
    marks = [timer.mark(), timer.mark()]
    assert timer.resolve(marks) == marks and before <= marks[0] <= marks[1] <= time.perf_counter_ns()
    assert timer.step_memory() is None


def test_events_are_placed_by_their_device_times_and_the_earliest_consistent_anchor() -> None:
    """Events 0, 2 ms, 5 ms apart on the device; recorded on the host at once (the GPU behind the host):
    the device gaps are kept, and the first event lands at its host recording time, not before."""
    peaks = [1]
    timer = _timer(peaks)
    timer.begin_step()
    assert peaks == []  # the allocator's peaks reset when a step begins
    marks = []
    for device_ns in (10_000_000, 12_000_000, 15_000_000):
        FakeEvent.clock[0] = device_ns
        marks.append(timer.mark())
    time.sleep(0.02)  # the device runs them over the next 5 ms or more, done before the synchronisation
    times = timer.resolve(marks)
    assert [b - a for a, b in zip(times, times[1:])] == [2_000_000, 3_000_000]
    assert times[0] == marks[0][1]  # the host recorded every event before the device ran it: the first is tight
    assert all(t >= host for t, (_, host) in zip(times, marks))
    assert times[-1] <= time.perf_counter_ns()
    assert timer.step_memory() == (300, 512)


def test_a_late_host_mark_bounds_the_events_from_below() -> None:
    """The host recorded the last event 50 ms after the first while the device shows 1 ms: the GPU was idle,
    the events ran as they were recorded; the last one's host time anchors them."""
    timer = _timer([])
    FakeEvent.clock[0] = 0
    first = timer.mark()
    time.sleep(0.05)
    FakeEvent.clock[0] = 1_000_000
    last = timer.mark()
    t0, t1 = timer.resolve([first, last])
    assert t1 - t0 == 1_000_000 and t1 == last[1]


def test_the_executor_records_the_timer_s_times() -> None:
    """One rank's step: every action's start and end come from the timer's ``resolve``, after the step."""
    config = train_config(
        schedule="1f1b",
        num_stages=1,
        num_microbatches=2,
        batch_size=4,
        steps=1,
        model=ModelSpec(kind="mlp", layers=2, hidden=4),
    )
    plan = prepare(config)
    low = lower(plan.schedule)
    workers = build_workers(plan, 0, torch.device("cpu"), row=low.actions[0])
    executor = Executor(low, 0, workers, plan.microbatch_sizes, torch.device("cpu"))
    resolved: list[int] = []

    class Counting(HostTimer):
        def resolve(self, marks: Any) -> list[int]:
            resolved.extend(range(1000, 1000 + len(marks)))
            return resolved

    object.__setattr__(executor, "timer", Counting())
    data = [torch.ones(2, 4), torch.ones(2, 4)]
    _, records = executor.run_step(data, [torch.zeros(2, 4)] * 2)
    assert [(t0, t1) for _, t0, t1 in records] == [(1000 + 2 * i, 1001 + 2 * i) for i in range(len(records))]
    assert executor.step_memory is None


def test_cuda_figures_reach_the_record_and_the_summary() -> None:
    """A CUDA run's per-step allocator peaks go into the record's figures and the summary's memory rows; a
    CPU run's say the host clock; ``--compile``'s first-step excess is its compile time."""
    ranks = [RankRecord(r, [], [], 0, 0, {}) for r in range(2)]
    for r, rank in enumerate(ranks):
        for step in range(3):
            rank.add_step(1.0, [(0, "F", 0, 0.0, 1.0)], 0, [], keep=False, memory=(100 * (r + 1) + step, 4096))
    record = SimpleNamespace(ranks=ranks, config=SimpleNamespace(training=SimpleNamespace(compile=True)))
    figures = device_figures(record, [5.0, 1.0, 1.2], range(1, 3))  # type: ignore[arg-type]
    assert figures["timing_source"] == "cuda events"
    assert figures["cuda_peak_allocated_bytes"] == [[100, 101, 102], [200, 201, 202]]
    assert figures["cuda_peak_reserved_bytes"] == [[4096] * 3] * 2
    assert figures["compile_s"] == pytest.approx(5.0 - 1.1)
    assert _cuda_peaks(figures, 1) == "  cuda allocated 202 B reserved 4.0 KiB"
    for rank in ranks:
        rank.cuda_allocated.clear()
    record.config.training.compile = False
    assert device_figures(record, [5.0, 1.0], range(1, 2)) == {"timing_source": "host clock"}  # type: ignore[arg-type]
