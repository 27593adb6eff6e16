"""Naive model parallelism: one microbatch in the pipeline at a time.

Each microbatch runs forward through every stage and back before the next one
starts, so D-1 of D ranks are always idle: bubble_ratio (D-1)/D for any T.
"""

from __future__ import annotations

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, append_updates, check_positive


def naive(num_stages: int, num_microbatches: int) -> Schedule:
    """Rank r runs ``F(r, j), B(r, j)`` for j = 0..T-1.

    Example:
        >>> [str(a) for a in naive(2, 2).actions[0]]
        ['0F0', '0B0', '0F1', '0B1', '0U0']
    """
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    placement = Placement.straight(num_stages)
    rows: list[list[Action]] = [
        [Action(r, op, j) for j in range(num_microbatches) for op in (Op.F, Op.B)] for r in range(num_stages)
    ]
    append_updates(rows, placement)
    return Schedule("naive", placement, num_microbatches, tuple(map(tuple, rows)))
