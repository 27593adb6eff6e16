"""1F1B: DAPPLE (Fan et al., PPoPP 2021) and PipeDream-Flush (Narayanan et al., ICML 2021).

Rank r (0-based) warms up with min(D-r-1, T) forwards, then alternates one
forward and one backward, then drains the remaining backwards. Same bubble as
GPipe, (D-1)/(T+D-1) at equal stage times, but rank r holds at most
min(D-r, T) microbatches of activations instead of T::

    rank 0 | F0 F1 F2 .. B0 F3 B1 .. B2 .. B3
    rank 1 | .. F0 F1 B0 F2 B1 F3 B2 .. B3 ..
    rank 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 ..
"""

from __future__ import annotations

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, append_updates, check_positive


def one_f_one_b_order(rank: int, num_ranks: int, num_microbatches: int) -> list[tuple[Op, int]]:
    """The (op, microbatch) order of one rank of 1F1B, ops F and B."""
    warmup = min(num_ranks - rank - 1, num_microbatches)
    order = [(Op.F, j) for j in range(warmup)]
    for j in range(num_microbatches - warmup):
        order += [(Op.F, warmup + j), (Op.B, j)]
    order += [(Op.B, j) for j in range(num_microbatches - warmup, num_microbatches)]
    return order


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """One-forward-one-backward with a flush, on D straight stages.

    Example:
        >>> [str(a) for a in one_f_one_b(2, 3).actions[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2', '0U0']
    """
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    placement = Placement.straight(num_stages)
    rows = [
        [Action(r, op, j) for op, j in one_f_one_b_order(r, num_stages, num_microbatches)] for r in range(num_stages)
    ]
    append_updates(rows, placement)
    return Schedule("1f1b", placement, num_microbatches, tuple(map(tuple, rows)))
