"""A compact time-aligned text timeline for terminals: one row per rank, idle as '.'.

Unlike ``schedule.grid`` (one column per step), columns here are time, so the
bubbles show where they are. 1F1B on 3 ranks and 4 microbatches, f = b = w = 1
(a B lasts b + w = 2 units), in 60 columns::

    rank 0 |F0F1F2........B0  F3B1  ..B2  ..B3
    rank 1 |..F0F1....B0  F2B1  F3B2  ..B3  ....
    rank 2 |....F0B0  F1B1  F2B2  F3B3  ........
    legend: F forward, B backward, . idle, 1 column = 0.5 time units

A box is its op letter and microbatch number, padded with spaces to its
length; without room for the number only the letter is drawn. The second
half of an F&B pair (``Schedule.pairs``) is marked ``&``: ``F3&b0``.
"""

from __future__ import annotations

from pipeweave.schedule.ir import Op, Schedule
from pipeweave.sim.timeline import Timeline

_NAMES = {
    Op.F: "forward",
    Op.B: "backward",
    Op.I: "input grad",
    Op.W: "weight grad",
    Op.OFFLOAD: "offload",
    Op.RELOAD: "reload",
    Op.EVICT: "evict",
    Op.LOAD: "load",
}
_LETTERS = {Op.OFFLOAD: "O", Op.RELOAD: "R", Op.EVICT: "E", Op.LOAD: "L"}  # memory actions (schedule.levers)


def chunk_of_stages(schedule: Schedule) -> list[int]:
    """Per stage, its index among the stages of its rank (0: first chunk or direction)."""
    chunk = [0] * schedule.num_stages
    for rank in range(schedule.placement.num_ranks):
        for k, stage in enumerate(schedule.placement.stages_on(rank)):
            chunk[stage] = k
    return chunk


def _scale(makespan: float, shortest: float, columns: int) -> float:
    """Columns per time unit: a whole number (1..4) of columns for the shortest
    box when that fits, so that equal boxes are equally wide; otherwise the
    shortest box's length times a power of two per column."""
    if makespan <= 0 or shortest <= 0:
        return 1.0
    per_box = int(columns * shortest / makespan)
    if per_box >= 1:
        return min(per_box, 4) / shortest
    scale = 1.0 / shortest
    while makespan * scale > columns:
        scale /= 2
    return scale


def _render_row(events: list[tuple[float, float, str, str]], origin: float, scale: float, width: int) -> str:
    cells = ["."] * width
    for start, end, letter, label in events:
        c0 = int(round((start - origin) * scale))
        c1 = max(c0 + 1, int(round((end - origin) * scale)))
        c0, c1 = min(c0, width - 1), min(c1, width)
        text = label if len(label) <= c1 - c0 else letter
        for k in range(c0, c1):
            i = k - c0
            cells[k] = text[i] if i < len(text) else " "
    return "".join(cells)


def format_timeline(timeline: Timeline, *, width: int = 100, max_ranks: int = 32) -> str:
    """Render ``timeline`` in about ``width`` columns, with a legend line.

    Args:
        timeline: a simulated (or measured) timeline.
        width: total columns, labels included.
        max_ranks: rows shown; the first and last halves when there are more ranks.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.timeline import simulate
        >>> print(format_timeline(simulate(generate("gpipe", num_stages=2, num_microbatches=2)), width=24))
        rank 0 |FF...B0B1
        rank 1 |.FFB0B1..
        legend: F forward, B backward, . idle, 1 column = 1 time unit
    """
    schedule = timeline.schedule
    chunk = chunk_of_stages(schedule)
    rows = [[e for e in row if e.end > e.start] for row in timeline.events]
    starts = [row[0].start for row in rows if row]
    origin = min(starts, default=0.0)
    makespan = max((e.end for row in rows for e in row), default=0.0) - origin
    label_width = len(f"rank {len(rows) - 1} |")
    shortest = min((e.end - e.start for row in rows for e in row), default=0.0)
    scale = _scale(makespan, shortest, max(10, width - label_width))
    columns = max(1, int(round(makespan * scale)))
    shown = list(range(len(rows)))
    if len(rows) > max_ranks:
        shown = shown[: max_ranks // 2] + [-1] + shown[len(rows) - max_ranks // 2 :]
    seconds = {b for _, b in schedule.pairs}
    lines = []
    for r in shown:
        if r < 0:
            lines.append("...".rjust(label_width - 2))
            continue
        boxes = []
        for e in rows[r]:
            s, op, j = e.action
            letter = _LETTERS.get(op, op.value)
            letter = letter if chunk[s] == 0 else letter.lower()
            mark = "&" if e.action in seconds else ""
            boxes.append((e.start, e.end, letter, f"{mark}{letter}{j}"))
        lines.append(f"{f'rank {r}'.ljust(label_width - 2)} |{_render_row(boxes, origin, scale, columns)}")
    lines.append(_legend(timeline, scale, any(c > 0 for c in chunk)))
    return "\n".join(lines)


def _legend(timeline: Timeline, scale: float, chunked: bool) -> str:
    ops = {e.action.op for row in timeline.events for e in row}
    parts = [f"{_LETTERS.get(op, op.value)} {_NAMES[op]}" for op in _NAMES if op in ops]
    if chunked:
        parts.append("lower case: a later chunk or direction")
    if timeline.schedule.pairs:
        parts.append("&: an F&B pair's second half")
    unit = 1 / scale
    parts.append(". idle")
    parts.append(f"1 column = {unit:.3g} time unit{'s' if unit != 1 else ''}")
    return "legend: " + ", ".join(parts)
