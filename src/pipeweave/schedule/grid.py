"""A compact text grid of a schedule: one row per rank, one column per step (an F&B pair one, ``3F5&0B0``).

Example (1F1B, 2 stages, 3 microbatches)::

    rank 0 | 0F0 0F1 0B0 0F2 0B1 0B2 0U0
    rank 1 | 1F0 1B0 1F1 1B1 1F2 1B2 1U0
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pipeweave.schedule.ir import Action, Schedule


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None, max_steps: int = 48) -> str:
    """Render the action lists; ``mark=(rank, step)`` brackets one cell.

    Args:
        schedule: the schedule to draw.
        mark: a cell to highlight as ``[1B0]``, e.g. the step a validator rejects.
        max_steps: columns shown; around ``mark`` when it is given.
    """
    return format_rows(schedule.actions, () if mark is None else (mark,), max_steps, schedule.pairs)


def _cells(row: Sequence[Action], second: dict[Action, Action]) -> tuple[list[str], list[int]]:
    """A row's cells, an F&B pair one cell ``3F5&0B0``, and the cell of each action."""
    cells: list[str] = []
    column: list[int] = []
    for i, a in enumerate(row):
        if i and second.get(row[i - 1]) == a:
            column.append(len(cells) - 1)
            continue
        b = second.get(a)
        cells.append(str(a) if b is None else f"{a}&{b}")
        column.append(len(cells) - 1)
    return cells, column


def format_rows(
    rows: Sequence[Sequence[Action]],
    marks: Collection[tuple[int, int]] = (),
    max_steps: int = 48,
    pairs: Sequence[tuple[Action, Action]] = (),
) -> str:
    """``format_grid`` of any action lists (a lowered schedule's too), every ``(rank, step)`` of ``marks``
    bracketed; the columns shown are around the earliest mark.

    Example:
        >>> from pipeweave.schedule import generate
        >>> print(format_rows(generate("1f1b", num_stages=2, num_microbatches=2).actions, [(0, 1), (1, 0)]))
        rank 0 | 0F0 [0F1] 0B0  0B1  0U0
        rank 1 |[1F0] 1B0  1F1  1B1  1U0
    """
    second = dict(pairs)
    laid = [_cells(row, second) for row in rows]
    cells = [c for c, _ in laid]
    marks = {(r, laid[r][1][k]) for r, k in marks if 0 <= r < len(laid) and 0 <= k < len(laid[r][1])}
    mark = min(marks, key=lambda m: m[1]) if marks else None
    width = max((len(c) for row in cells for c in row), default=3) + 2
    longest = max((len(row) for row in cells), default=0)
    lo = 0
    if mark is not None and mark[1] >= max_steps:
        lo = max(0, mark[1] - max_steps // 2)
    hi = min(longest, lo + max_steps)
    label = len(f"rank {len(cells) - 1}")
    lines = []
    for r, row in enumerate(cells):
        shown = []
        for k in range(lo, min(hi, len(row))):
            text = f"[{row[k]}]" if (r, k) in marks else f" {row[k]} "
            shown.append(text.ljust(width))
        tail = " ..." if len(row) > hi else ""
        head = "... " if lo > 0 else ""
        lines.append(f"{f'rank {r}'.ljust(label)} |{head}{''.join(shown).rstrip()}{tail}")
    return "\n".join(lines)
