"""Chrome trace JSON of a timeline, for chrome://tracing and Perfetto (ui.perfetto.dev).

One process per rank (named "rank r", sorted by rank), one complete event
(``"ph": "X"``) per action, named as the action (``"1F3"``), with category its
op and ``args`` its stage, microbatch and op; each F&B pair (``Schedule.pairs``)
is one more event on a second track of its rank, ``F&B 3F5;0B0`` from its F
half's start to its B half's end, whose ``args`` give ``exposed``: the time
between the halves, when the B half's message had not yet arrived -- the
communication the pair did not hide. Trace times are microseconds;
the timeline's time unit is mapped to ``us_per_unit`` of them (default 1000:
one unit reads as 1 ms, so f = b = w = 1 shows millisecond boxes). ``U``
takes no time and appears as a zero-length event.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeweave.sim.timeline import Timeline


def chrome_trace(timeline: Timeline, *, us_per_unit: float = 1000.0) -> dict[str, Any]:
    """The trace as a JSON-ready dict (``{"traceEvents": [...], ...}``).

    Args:
        timeline: a simulated or measured timeline.
        us_per_unit: trace microseconds per time unit of the timeline.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.timeline import simulate
        >>> trace = chrome_trace(simulate(generate("gpipe", num_stages=2, num_microbatches=1)))
        >>> [(e["name"], e["pid"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"][:2]
        [('0F0', 0, 0.0, 1000.0), ('0B0', 0, 4000.0, 2000.0)]
    """
    events: list[dict[str, Any]] = []
    for rank in range(len(timeline.events)):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for rank, row in enumerate(timeline.events):
        for e in row:
            s, op, j = e.action
            events.append(
                {
                    "name": str(e.action),
                    "cat": op.value,
                    "ph": "X",
                    "pid": rank,
                    "tid": 0,
                    "ts": e.start * us_per_unit,
                    "dur": (e.end - e.start) * us_per_unit,
                    "args": {"stage": s, "microbatch": j, "op": op.value},
                }
            )
    schedule = timeline.schedule
    events += _pair_events(timeline, us_per_unit)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": schedule.name,
            "stages": schedule.num_ranks,
            "microbatches": schedule.num_microbatches,
            "us_per_time_unit": us_per_unit,
        },
    }


def _pair_events(timeline: Timeline, us_per_unit: float) -> list[dict[str, Any]]:
    """One event per F&B pair, on track 1 of its rank: the pair's span, and what its B half waited."""
    if not timeline.schedule.pairs:
        return []
    out = []
    for rank, row in enumerate(timeline.events):
        at = {e.action: e for e in row}
        for f, b in timeline.schedule.pairs:
            if f in at and b in at:
                first, second = at[f], at[b]
                out.append(
                    {
                        "name": f"F&B {f};{b}",
                        "cat": "F&B",
                        "ph": "X",
                        "pid": rank,
                        "tid": 1,
                        "ts": first.start * us_per_unit,
                        "dur": (second.end - first.start) * us_per_unit,
                        "args": {"exposed": (second.start - first.end) * us_per_unit},
                    }
                )
    return out


def write_trace(timeline: Timeline, path: str | Path, *, us_per_unit: float = 1000.0) -> Path:
    """Write ``chrome_trace(timeline)`` as JSON to ``path``; open it in Perfetto."""
    path = Path(path)
    with path.open("w") as out:
        json.dump(chrome_trace(timeline, us_per_unit=us_per_unit), out, separators=(",", ":"))
    return path
