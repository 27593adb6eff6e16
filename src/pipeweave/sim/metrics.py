"""The metrics of DESIGN.md, computed one way for simulated and measured timelines.

- ``makespan``: first start to last end of the step;
- ``span[r]``: rank r's first start to its last end;
- ``bubble_ratio`` = 1 - busy / (ranks x max span) (zero-bubble paper's bubble rate);
- ``bubble_ratio_flush`` = 1 - busy / (ranks x makespan) (steps end in a barrier);
- ``bubble_overhead`` = idle / busy over the max span (Megatron-LM's (D-1)/(vT));
- ``peak_activations[r]``: peak activation memory of rank r, in the cost model's
  units of M_a (allocated when F starts, released when B ends, or (1 - mem_w)
  of it when I ends and the rest when W ends; a part recomputing in full
  holds its replayed activations on top while its backward runs);
- ``weight_versions[r]``: peak weight copies held by rank r, in M_theta;
- ``staleness[s]``: per stage, the largest number of updates between the
  version a gradient was computed on and the version it is applied to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.sim.arrays import schedule_arrays
from pipeweave.sim.bubble import bubble_metrics
from pipeweave.sim.cost import PartCosts
from pipeweave.sim.steady import steady_bubble_ratio
from pipeweave.sim.timeline import Timeline
from pipeweave.sim.versions import inconsistency, staleness, weight_copies


@dataclass(frozen=True)
class Metrics:
    """Metrics of one step of a timeline (see the module docstring)."""

    makespan: float
    span: tuple[float, ...]
    busy: tuple[float, ...]
    bubble_ratio: float
    bubble_ratio_flush: float
    bubble_overhead: float
    peak_activations: tuple[float, ...]
    weight_versions: tuple[float, ...]
    staleness: tuple[int, ...]
    inconsistency: tuple[int, ...] = ()
    """Per stage, the most versions between a backward's weights and its forward's."""
    steady_bubble_ratio: float = 0.0
    """Bubble of an asynchronous stream's steady state (sim.steady); bubble_ratio for one step."""

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def peak_activations(timeline: Timeline, costs: PartCosts) -> tuple[float, ...]:
    """Per rank, the peak activation memory under the cost model's M_a and M_W."""
    held, replayed = costs.activation, costs.replayed or None
    stash = tuple(a * costs.mem_w for a in held)
    if timeline.times is not None:  # simulated: its rows are the schedule's
        return _array_peaks(timeline.schedule, held, stash, replayed)
    rows = ((e.action for e in row) for row in timeline.events)
    return held_peaks(rows, timeline.schedule.placement.stage_part, held, stash, replayed, replayed)


def held_peaks(
    rows: Iterable[Iterable[Action]],
    part_of: Sequence[int],
    held: Sequence[float],
    stash: Sequence[float],
    during_b: Sequence[float] | None = None,
    during_i: Sequence[float] | None = None,
) -> tuple[float, ...]:
    """Per rank, the peak memory held for backwards, walking each rank's actions in their order.

    Per part: an ``F`` adds ``held`` (what a microbatch keeps from its F to its
    backward); an ``I`` exchanges it for ``stash`` (what its ``W`` still needs),
    which the ``W`` frees; a ``B`` frees ``held``. ``during_b`` and
    ``during_i`` are what a ``B`` or an ``I`` of the part uses on top while it
    runs (a recomputation's replayed forward; 0 by default). The order alone
    decides, not the times: a rank runs its actions one after another, so
    ``rows`` may be a schedule's own (``schedule.actions``) as well as a timeline's.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = generate("1f1b", num_stages=2, num_microbatches=4)
        >>> held_peaks(s.actions, s.placement.stage_part, held=(2.0, 1.0), stash=(0.0, 0.0), during_b=(3.0, 0.0))
        (7.0, 1.0)
    """
    zeros = [0.0] * len(held)
    extra_b, extra_i = during_b or zeros, during_i or zeros
    peaks = []
    for row in rows:
        now = peak = 0.0
        for s, op, _ in row:
            part = part_of[s]
            if op is Op.F:
                now += held[part]
            elif op is Op.B:
                peak = max(peak, now + extra_b[part])
                now -= held[part]
            elif op is Op.I:
                peak = max(peak, now + extra_i[part])
                now += stash[part] - held[part]
            elif op is Op.W:
                now -= stash[part]
            peak = max(peak, now)
        peaks.append(round(peak, 9))
    return tuple(peaks)


def _array_peaks(
    schedule: Schedule, held: Sequence[float], stash: Sequence[float], replayed: Sequence[float] | None = None
) -> tuple[float, ...]:
    """``held_peaks`` of a schedule's own rows over its arrays: per rank, the running sum of what
    each action adds (F: held, B: -held, I: stash - held, W: -stash, U: 0), summed in order as
    the reference does (``np.add.accumulate`` adds left to right), and its peak; with ``replayed``,
    also the sum before each B or I plus what it replays (``during_b``/``during_i`` of ``held_peaks``)."""
    arrays = schedule_arrays(schedule)
    part_of = schedule.placement.stage_part
    if not arrays.ok:
        return held_peaks(schedule.actions, part_of, held, stash, replayed, replayed)
    table = np.array([[held[p], -held[p], stash[p] - held[p], -stash[p], 0.0] for p in part_of]).reshape(-1, 5)
    added = table[arrays.stage, arrays.op]
    on_top = None
    if replayed is not None and any(replayed):
        on_top = np.array([[0.0, replayed[p], replayed[p], 0.0, 0.0] for p in part_of]).reshape(-1, 5)
        on_top = on_top[arrays.stage, arrays.op]
    bounds = arrays.offsets.tolist()
    return tuple(_row_peak(added[a:b], None if on_top is None else on_top[a:b]) for a, b in zip(bounds, bounds[1:]))


def _row_peak(added: np.ndarray, on_top: np.ndarray | None) -> float:
    """One rank's peak: of the running sum of ``added``, and of each sum before an action plus ``on_top``."""
    if not len(added):
        return 0.0
    running = np.add.accumulate(added)
    peak = float(running.max())
    if on_top is not None:
        before = np.concatenate(([0.0], running[:-1]))
        peak = max(peak, float((before + on_top).max()))
    return round(max(0.0, peak), 9)


def compute_metrics(timeline: Timeline, costs: PartCosts | None = None) -> Metrics:
    """All metrics of a timeline; ``costs`` defaults to the simulated timeline's own.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.timeline import simulate
        >>> m = compute_metrics(simulate(generate("1f1b", num_stages=4, num_microbatches=8)))
        >>> round(m.bubble_ratio, 4), m.peak_activations
        (0.2727, (4.0, 3.0, 2.0, 1.0))
    """
    costs = costs or timeline.costs
    if costs is None:
        raise ValueError("a measured timeline needs its cost model for memory metrics; pass costs=")
    makespan, span, busy, ratio, flush, overhead = bubble_metrics(timeline)
    schedule = timeline.schedule
    weights, lag, gap = version_metrics(schedule, costs)
    return Metrics(
        makespan=makespan,
        span=span,
        busy=busy,
        bubble_ratio=ratio,
        bubble_ratio_flush=flush,
        bubble_overhead=overhead,
        peak_activations=peak_activations(timeline, costs),
        weight_versions=weights,
        staleness=lag,
        inconsistency=gap,
        # One step has no steady state: steady.py would recompute this same ratio.
        steady_bubble_ratio=steady_bubble_ratio(timeline) if schedule.num_steps >= 3 else ratio,
    )


def version_metrics(schedule: Schedule, costs: PartCosts) -> tuple[tuple[float, ...], tuple[int, ...], tuple[int, ...]]:
    """``(weight_versions, staleness, inconsistency)`` of a schedule.

    A synchronous schedule has them in closed form: every action reads version
    0 and ``U(s, 0)`` applies all of its part's gradients (the validator's
    update rule), so each stage holds one copy and both lags are 0. That is
    what ``sim.versions`` derives too, through per-action maps built three
    times over, slow and large at big D and T (benchmarks/simulator/README.md).
    Asynchronous schedules go through it.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.cost import CostModel
        >>> version_metrics(generate("gpipe", num_stages=2, num_microbatches=3),
        ...                 CostModel().for_parts(num_parts=2, num_ranks=2))
        ((1.0, 1.0), (0, 0), (0, 0))
    """
    if not schedule.is_synchronous:
        return weight_copies(schedule, costs), staleness(schedule), inconsistency(schedule)
    held = [0.0] * schedule.num_ranks
    part_of = schedule.placement.stage_part
    for stage, rank in enumerate(schedule.placement.stage_rank):
        held[rank] += costs.weight[part_of[stage]]
    zeros = (0,) * schedule.num_stages
    return tuple(round(h, 9) for h in held), zeros, zeros
