"""GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards, then a flush.

Legend: rank r runs F(r, 0..T-1), then B(r, 0..T-1) (torch's ScheduleGPipe
order), then U. With equal stage times and no communication the bubble ratio
is (D-1)/(T+D-1) and every rank holds T microbatches of activations::

    rank 0 | F0 F1 F2 .. .. .. B0 B1 B2
    rank 1 | .. F0 F1 F2 .. B0 B1 B2 ..
    rank 2 | .. .. F0 F1 F2 B0 B1 B2 ..   (B drawn as wide as F)
"""

from __future__ import annotations

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, append_updates, check_positive


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards, on D straight stages.

    Example:
        >>> [str(a) for a in gpipe(2, 2).actions[1]]
        ['1F0', '1F1', '1B0', '1B1', '1U0']
    """
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    placement = Placement.straight(num_stages)
    t = range(num_microbatches)
    rows = [[Action(r, Op.F, j) for j in t] + [Action(r, Op.B, j) for j in t] for r in range(num_stages)]
    append_updates(rows, placement)
    return Schedule("gpipe", placement, num_microbatches, tuple(map(tuple, rows)))
