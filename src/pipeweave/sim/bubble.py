"""The bubble of a timeline: makespan, spans, busy time and the three bubble figures of DESIGN.md.

One definition for simulated and measured timelines (``sim.metrics`` and
``sim.steady`` build on it): ``bubble_ratio`` = 1 - busy / (ranks x max span),
``bubble_ratio_flush`` = 1 - busy / (ranks x makespan), ``bubble_overhead`` =
idle / busy over the max span.
"""

from __future__ import annotations

import sys

import numpy as np
from numpy.typing import NDArray

from pipeweave.schedule.ir import Op
from pipeweave.sim.timeline import Timeline, Times

_COMPUTE = frozenset(op for op in Op if op.is_compute)


def bubble_metrics(timeline: Timeline) -> tuple[float, tuple[float, ...], tuple[float, ...], float, float, float]:
    """``(makespan, span, busy, bubble_ratio, bubble_ratio_flush, bubble_overhead)``."""
    if timeline.times is not None:
        return _from_times(timeline.times)
    rows = [row for row in timeline.events if row]
    if not rows:
        return 0.0, (), (), 0.0, 0.0, 0.0
    first = min(row[0].start for row in rows)
    last = max(max(e.end for e in row) for row in rows)
    makespan = last - first
    span = tuple((max(e.end for e in row) - row[0].start) if row else 0.0 for row in timeline.events)
    busy = tuple(sum(e.end - e.start for e in row if e.action.op in _COMPUTE) for row in timeline.events)
    n, total, widest = len(timeline.events), sum(busy), max(span)
    ratio = 1.0 - total / (n * widest) if widest > 0 else 0.0
    flush = 1.0 - total / (n * makespan) if makespan > 0 else 0.0
    overhead = (n * widest - total) / total if total > 0 else 0.0
    return makespan, span, busy, ratio, flush, overhead


def _from_times(times: Times) -> tuple[float, tuple[float, ...], tuple[float, ...], float, float, float]:
    """``bubble_metrics`` of the fast simulator's arrays, by the same float operations (its actions
    are all compute: the simulator takes no communication ops)."""
    bounds = times.offsets.tolist()
    rows = [(a, b) for a, b in zip(bounds, bounds[1:])]
    if all(a == b for a, b in rows):
        return 0.0, (), (), 0.0, 0.0, 0.0
    took = times.end - times.start
    ends = [float(times.end[a:b].max()) if b > a else 0.0 for a, b in rows]
    starts = times.start[[a for a, b in rows if b > a]].tolist()
    first = min(starts)
    last = max(e for e, (a, b) in zip(ends, rows) if b > a)
    makespan = last - first
    span = tuple((e - float(times.start[a])) if b > a else 0.0 for e, (a, b) in zip(ends, rows))
    busy = tuple(python_sum(took[a:b]) for a, b in rows)
    n, total, widest = len(rows), sum(busy), max(span)
    ratio = 1.0 - total / (n * widest) if widest > 0 else 0.0
    flush = 1.0 - total / (n * makespan) if makespan > 0 else 0.0
    overhead = (n * widest - total) / total if total > 0 else 0.0
    return makespan, span, busy, ratio, flush, overhead


def python_sum(values: NDArray[np.float64]) -> float:
    """``sum(values)`` as Python computes it, rounding included: left to right before Python 3.12
    (``np.add.accumulate`` adds in that order; ``np.sum`` would add pairwise), compensated since.

    Example:
        >>> python_sum(np.array([0.1, 0.2, 0.3])) == sum([0.1, 0.2, 0.3])
        True
    """
    if sys.version_info >= (3, 12):
        return sum(values.tolist())
    return float(np.add.accumulate(values)[-1]) if values.size else 0
