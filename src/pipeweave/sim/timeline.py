"""Discrete-event simulation of a schedule: when each action starts and ends.

Each rank runs its list in order; an action starts once its rank is free and its
inputs have arrived (plus one hop of ``comm`` when they come from another rank).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from pipeweave.schedule.dataflow import execute
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.schedule.validate import InvalidSchedule, check_actions, check_order
from pipeweave.sim.cost import CostModel, PartCosts

BYTES_PER_ACTION = 300
"""Memory the simulation of one action takes: its action, event and metrics together (the measurement:
benchmarks/simulator/README.md). ``pipeweave simulate`` and ``train`` refuse a schedule whose actions
at this size would not fit in free memory."""


class Event(NamedTuple):
    """One action of one rank, with its start and end time."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Per rank, the events in execution order (simulated or measured).

    Attributes:
        schedule: what ran.
        events: per rank, its events in order.
        costs: the resolved cost model, when simulated (None for measured runs).
    """

    schedule: Schedule
    events: tuple[tuple[Event, ...], ...]
    costs: PartCosts | None = None


def action_time(costs: PartCosts, part: int, op: Op) -> float:
    """Duration of ``op`` on ``part`` (B = I + W; communication takes 0, its latency is the hop's)."""
    if op is Op.F:
        return costs.f[part]
    if op is Op.B:
        return costs.b[part] + costs.w[part]
    if op is Op.I:
        return costs.b[part]
    if op is Op.W:
        return costs.w[part]
    if op is Op.U:
        return costs.u[part]
    return 0.0


def simulate(schedule: Schedule, cost: CostModel | None = None, *, check: bool = True) -> Timeline:
    """Time every action of ``schedule`` under ``cost``.

    Args:
        schedule: any schedule of the IR.
        cost: the cost model (default: f = b = w = 1, no communication).
        check: validate the actions first (skip only for schedules known good).

    Raises:
        InvalidSchedule: the schedule breaks a rule or deadlocks.

    Example:
        >>> from pipeweave.schedule import generate
        >>> t = simulate(generate("gpipe", num_stages=2, num_microbatches=2))
        >>> [(str(e.action), e.start, e.end) for e in t.events[1][:2]]
        [('1F0', 1.0, 2.0), ('1F1', 2.0, 3.0)]
    """
    cost = cost or CostModel()
    costs = cost.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    comm = costs.comm
    return simulate_parts(schedule, costs, check=check, hop=(lambda src, dst: comm) if comm else None)


def simulate_parts(schedule: Schedule, costs: PartCosts, *, check: bool = True,
                   hop: Callable[[int, int], float] | None = None,
                   update_delay: Sequence[float] | None = None) -> Timeline:
    """Time every action of ``schedule`` under costs already resolved per part (``simulate``'s core).

    Args:
        schedule: any schedule of the IR.
        costs: one value per part (``CostModel.for_parts``, or ``sim.parallel.layout_costs``).
        check: validate the actions first.
        hop: time of a message from one stage to another on a different rank (default: none).
        update_delay: per part, the data-parallel reduction between its last weight gradient and its
            ``U`` (``schedule.dataflow.execute``); default none.

    Raises:
        InvalidSchedule: the schedule breaks a rule or deadlocks.
    """
    part_of = schedule.placement.stage_part
    if check:
        check_actions(schedule)
    # A table per stage instead of a call per action: the walk's hot loop.
    op_times = [{op: action_time(costs, part, op) for op in Op} for part in part_of]
    with _gc_paused():
        run = execute(schedule, latency=hop, op_times=op_times, gap=costs.dispatch, update_delay=update_delay)
        if not run.complete:
            check_order(schedule)  # raises with the explanation
            raise InvalidSchedule("the schedule cannot complete", schedule)  # pragma: no cover
        events = tuple(
            tuple(map(Event, row, starts, ends)) for row, starts, ends in zip(schedule.actions, run.start, run.end)
        )
    return Timeline(schedule, events, costs)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while millions of tuples are made.

    None of them forms a cycle, yet every few hundred allocations the collector
    scans the young ones and now and then everything alive: at D=1024, T=4096
    (8.4 M events) that was a third of the simulation's time.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
