"""The steady-state bubble of an asynchronous stream: idle time once warm-up is over and before drain.

A stream of S mini-batches spends its first and last on filling and draining
the pipeline, which a longer run amortises. Its steady state is the rest: on
each rank, from the start of its first action on a microbatch of mini-batch 1
to the end of its last action on a microbatch of mini-batch S - 2. Over those
per-rank windows, ``steady_bubble_ratio`` = 1 - busy / window time. With fewer
than 3 mini-batches there is no steady state and it is the whole timeline's.
"""

from __future__ import annotations

from pipeweave.schedule.ir import Op
from pipeweave.sim.bubble import bubble_metrics
from pipeweave.sim.timeline import Timeline

_COMPUTE = frozenset(op for op in Op if op.is_compute)


def steady_windows(timeline: Timeline) -> list[tuple[float, float]]:
    """Per rank, the (start, end) of its steady state (the whole row when there is none)."""
    schedule = timeline.schedule
    per_step = schedule.num_microbatches // max(1, schedule.num_steps)
    lo, hi = (per_step, (schedule.num_steps - 1) * per_step) if schedule.num_steps >= 3 else (0, 1 << 62)
    windows = []
    for row in timeline.events:
        inside = [e for e in row if e.action.op is not Op.U and lo <= e.action.microbatch < hi]
        chosen = inside or list(row)
        windows.append((min(e.start for e in chosen), max(e.end for e in chosen)) if chosen else (0.0, 0.0))
    return windows


def steady_bubble_ratio(timeline: Timeline) -> float:
    """1 - busy / time over each rank's steady-state window (see the module docstring).

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.timeline import simulate
        >>> steady_bubble_ratio(simulate(generate("pipedream", num_stages=4, num_microbatches=4)))
        0.0
    """
    schedule = timeline.schedule
    if schedule.num_steps < 3:
        return bubble_metrics(timeline)[3]
    busy = total = 0.0
    for row, (t0, t1) in zip(timeline.events, steady_windows(timeline)):
        total += t1 - t0
        busy += sum(max(0.0, min(e.end, t1) - max(e.start, t0)) for e in row if e.action.op in _COMPUTE)
    return 1.0 - busy / total if total > 0 else 0.0
