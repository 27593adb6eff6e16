"""Discrete-event simulation of a schedule: when each action starts and ends.

Each rank runs its list in order; an action starts once its rank is free and its
inputs have arrived (plus one hop of ``comm`` when they come from another rank).
Two engines give the same times bit for bit: ``sim.rounds`` over numpy arrays
(the default) and the reference, ``schedule.dataflow``'s in-order walk in pure
Python (``fast=False``, and wherever the fast one does not apply).
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipeweave.errors import UserError
from pipeweave.schedule.dataflow import execute
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.schedule.validate import InvalidSchedule, check_actions, check_order
from pipeweave.sim.arrays import schedule_arrays
from pipeweave.sim.cost import CostModel, PartCosts
from pipeweave.sim.rounds import fast_times

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
class Times:
    """The fast simulator's output: start and end of every action, ranks one after another.

    Attributes:
        start, end: per action, in the order of ``sim.arrays.ScheduleArrays``.
        offsets: ``offsets[r]`` is the index of rank r's first action.
    """

    start: NDArray[np.float64]
    end: NDArray[np.float64]
    offsets: NDArray[np.int64]

    def rows(self) -> list[tuple[list[float], list[float]]]:
        """Per rank, its starts and ends as Python floats."""
        bounds = self.offsets.tolist()
        return [(self.start[a:b].tolist(), self.end[a:b].tolist()) for a, b in zip(bounds, bounds[1:])]


class Timeline:
    """Per rank, the events in execution order (simulated or measured); immutable.

    Attributes:
        schedule: what ran.
        events: per rank, its events in order (made on first use when the fast
            simulator gave only ``times``).
        costs: the resolved cost model, when simulated (None for measured runs).
        times: the fast simulator's arrays (None otherwise); the metrics read them directly.
    """

    __slots__ = ("schedule", "costs", "times", "_events")
    schedule: Schedule
    costs: PartCosts | None
    times: Times | None
    _events: tuple[tuple[Event, ...], ...] | None

    def __init__(
        self,
        schedule: Schedule,
        events: tuple[tuple[Event, ...], ...] | None = None,
        costs: PartCosts | None = None,
        *,
        times: Times | None = None,
    ) -> None:
        if events is None and times is None:
            raise ValueError("a Timeline needs its events or its times")
        for name, value in (("schedule", schedule), ("costs", costs), ("times", times), ("_events", events)):
            object.__setattr__(self, name, value)

    @property
    def events(self) -> tuple[tuple[Event, ...], ...]:
        if self._events is None:
            assert self.times is not None
            rows = zip(self.schedule.actions, self.times.rows())
            object.__setattr__(
                self, "_events", tuple(tuple(map(Event, row, starts, ends)) for row, (starts, ends) in rows)
            )
        assert self._events is not None
        return self._events

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Timeline is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Timeline):
            return NotImplemented
        return (self.schedule, self.events, self.costs) == (other.schedule, other.events, other.costs)

    def __hash__(self) -> int:
        return hash((self.schedule, self.events, self.costs))

    def __repr__(self) -> str:
        return f"Timeline(schedule={self.schedule.name!r}, ranks={self.schedule.num_ranks}, costs={self.costs!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle and copy through the constructor (``__setattr__`` refuses the default way)."""
        return _timeline, (self.schedule, self._events, self.costs, self.times)


def _timeline(
    schedule: Schedule, events: tuple[tuple[Event, ...], ...] | None, costs: PartCosts | None, times: Times | None
) -> Timeline:
    """``Timeline``'s constructor with its keyword, for ``Timeline.__reduce__``."""
    return Timeline(schedule, events, costs, times=times)


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


def duration_table(costs: PartCosts, part_of: Sequence[int]) -> NDArray[np.float64]:
    """Per stage, the times of F, B, I, W and U (``sim.arrays``' op codes), as ``action_time`` gives them
    (B = I + W: the same float addition), built over numpy for the fast engine.

    Example:
        >>> from pipeweave.sim.cost import CostModel
        >>> duration_table(CostModel(w=0.5).for_parts(num_parts=2, num_ranks=2), (0, 1))[0].tolist()
        [1.0, 1.5, 1.0, 0.5, 0.0]
    """
    b, w = np.asarray(costs.b, dtype=np.float64), np.asarray(costs.w, dtype=np.float64)
    per_part = np.stack(
        (np.asarray(costs.f, dtype=np.float64), b + w, b, w, np.asarray(costs.u, dtype=np.float64)), axis=1
    )
    return per_part[np.asarray(part_of, dtype=np.intp)].reshape(len(part_of), 5)


def simulate(schedule: Schedule, cost: CostModel | None = None, *, check: bool = True, fast: bool = True) -> Timeline:
    """Time every action of ``schedule`` under ``cost``.

    Args:
        schedule: any schedule of the IR.
        cost: the cost model (default: f = b = w = 1, no communication).
        check: validate the actions first (skip only for schedules known good).
        fast: the fast engines (``sim.rounds``: numpy rounds, or from 50,000 actions the walk compiled by
            ``sim.compiled``; same times bit for bit); False forces the pure-Python reference.

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
    return simulate_parts(schedule, costs, check=check, hop=(lambda src, dst: comm) if comm else None, fast=fast)


def simulate_parts(
    schedule: Schedule,
    costs: PartCosts,
    *,
    check: bool = True,
    hop: Callable[[int, int], float] | None = None,
    update_delay: Sequence[float] | None = None,
    fast: bool = True,
    extra: Mapping[Action, float] | None = None,
) -> Timeline:
    """Time every action of ``schedule`` under costs already resolved per part (``simulate``'s core).

    Args:
        schedule: any schedule of the IR.
        costs: one value per part (``CostModel.for_parts``, or ``sim.parallel.layout_costs``).
        check: validate the actions first.
        hop: time of a message from one stage to another on a different rank (default: none).
        update_delay: per part, the data-parallel reduction between its last weight gradient and its
            ``U`` (``schedule.dataflow.execute``); default none.
        fast: the fast engines (``sim.rounds``, ``sim.compiled``; same times bit for bit); False forces the
            reference.
        extra: time added to these actions (the memory actions folded into their F and backward,
            ``sim.levers``); default none.

    Raises:
        InvalidSchedule: the schedule breaks a rule or deadlocks.
    """
    part_of = schedule.placement.stage_part
    if costs.microbatch is not None:  # per-microbatch times: the reference walk, an action at a time
        return _per_microbatch(schedule, costs, _op_times(costs, part_of), check, hop, update_delay)
    rendezvous = costs.comm_rendezvous and hop is not None  # the reference walk alone posts receives
    arrays = schedule_arrays(schedule) if fast and not rendezvous else None
    if arrays is not None and arrays.ok:
        table = duration_table(costs, part_of)
        added = (
            None
            if not extra
            else np.fromiter(
                (extra.get(a, 0.0) for row in schedule.actions for a in row), dtype=np.float64, count=arrays.size
            )
        )
        found = fast_times(
            schedule, arrays, table, latency=hop, gap=costs.dispatch, update_delay=update_delay, extra=added
        )
        if found is not None:
            return Timeline(schedule, costs=costs, times=Times(found[0], found[1], arrays.offsets))
    if check:
        check_actions(schedule)
    with _gc_paused():
        per_stage = _op_times(costs, part_of)
        duration = None if not extra else (lambda a: per_stage[a.stage][a.op] + extra.get(a, 0.0))
        run = execute(
            schedule,
            duration,
            latency=hop,
            op_times=per_stage,
            gap=costs.dispatch,
            update_delay=update_delay,
            rendezvous=rendezvous,
        )
        if not run.complete:
            check_order(schedule)  # raises with the explanation
            raise InvalidSchedule("the schedule cannot complete", schedule)  # pragma: no cover
        if arrays is not None and arrays.ok:  # the fast metrics read arrays
            start = np.fromiter(itertools.chain.from_iterable(run.start), dtype=np.float64, count=arrays.size)
            end = np.fromiter(itertools.chain.from_iterable(run.end), dtype=np.float64, count=arrays.size)
            return Timeline(schedule, costs=costs, times=Times(start, end, arrays.offsets))
        events = tuple(
            tuple(map(Event, row, starts, ends)) for row, starts, ends in zip(schedule.actions, run.start, run.end)
        )
    return Timeline(schedule, events, costs)


def _op_times(costs: PartCosts, part_of: Sequence[int]) -> list[dict[Op, float]]:
    """Per stage, each op's time: a table instead of a call per action, for the reference walk's hot loop."""
    return [{op: action_time(costs, part, op) for op in Op} for part in part_of]


def _per_microbatch(
    schedule: Schedule,
    costs: PartCosts,
    op_times: Sequence[dict[Op, float]],
    check: bool,
    hop: Callable[[int, int], float] | None,
    update_delay: Sequence[float] | None,
) -> Timeline:
    """``simulate_parts`` where each microbatch's F, B, I and W take their part's time x its factor.

    Raises:
        UserError: not one factor per microbatch of the step.
    """
    factors = costs.microbatch or ()
    if len(factors) != schedule.num_microbatches:
        raise UserError(
            f"cost microbatch has {len(factors)} factors for {schedule.num_microbatches} microbatches; "
            "give one per microbatch"
        )
    if check:
        check_actions(schedule)

    def duration(a: Action) -> float:
        base = op_times[a.stage][a.op]
        return base * factors[a.microbatch] if a.op in _PER_MICROBATCH else base

    run = execute(
        schedule, duration, hop, gap=costs.dispatch, update_delay=update_delay, rendezvous=costs.comm_rendezvous
    )
    if not run.complete:
        check_order(schedule)  # raises with the explanation
        raise InvalidSchedule("the schedule cannot complete", schedule)  # pragma: no cover
    events = tuple(
        tuple(map(Event, row, starts, ends)) for row, starts, ends in zip(schedule.actions, run.start, run.end)
    )
    return Timeline(schedule, events, costs)


_PER_MICROBATCH = frozenset((Op.F, Op.B, Op.I, Op.W))


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
