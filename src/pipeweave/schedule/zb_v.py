"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 6).

The model is cut into 2D parts placed in a V (``Placement.vshape``): rank r
holds chunk 0 = stage r on the way down and chunk 1 = stage 2D-1-r on the way
back up, so rank 0 holds both the first stage and the loss. Legend: F0/I0/W0
act on chunk 0, F1/I1/W1 on chunk 1. Rank r of D runs, for T >= 2D-1:

1. 2(D-r)-1 F0 (the down-going forwards that fill the time until the first
   microbatch comes back up);
2. r pairs F1 F0;
3. D-r triples F1 I1 W1;
4. steady state F0 I0 W0 F1 I1 W1, dropping F0 once all are done, until the
   last F1;
5. drain: I0, then r pairs I1 I0, then W I0 until the I0's are done, then the
   deferred W's in the order of their I's.

D = 1, T = 1 (stage 0 down, stage 1 up, both on rank 0)::

    rank 0 | 0F0 1F0 1I0 1W0 0I0 0W0

Closed forms (cost-model scalars are per D-th of the model, so each part
costs f/2, b/2, w/2 and holds M_a/2; no communication): at f = b = w and
T >= 2D-1 every rank is busy from its first action to its last (zero bubble,
``bubble_ratio`` 0), and every rank peaks at exactly D M_a (for any mem_w).
For T < 2D-1 the order is that of 2D-1 microbatches with the missing ones
left out (removing whole microbatches keeps a schedule valid); it stays valid
but has bubbles.
"""

from __future__ import annotations

from collections import deque

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, append_updates, check_positive


class _RankOrder:
    """Builds one rank's list, keeping per-chunk counters and the deferred W's."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        self.stages = (rank, 2 * num_ranks - 1 - rank)
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.pending: deque[Action] = deque()
        self.row: list[Action] = []

    def f(self, chunk: int) -> None:
        self.row.append(Action(self.stages[chunk], Op.F, self.forwards[chunk]))
        self.forwards[chunk] += 1

    def i(self, chunk: int, weight: bool) -> None:
        """An I; with ``weight`` its W follows at once, else the W is deferred."""
        stage, j = self.stages[chunk], self.backwards[chunk]
        self.row.append(Action(stage, Op.I, j))
        self.pending.append(Action(stage, Op.W, j))
        self.backwards[chunk] += 1
        if weight:
            self.w()

    def w(self) -> None:
        self.row.append(self.pending.popleft())


def zb_v_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s actions for T >= 2D-1 (the five phases of the module docstring)."""
    d, t = num_ranks, num_microbatches
    o = _RankOrder(rank, d)
    for _ in range(2 * (d - rank) - 1):
        o.f(0)
    for _ in range(rank):
        o.f(1)
        o.f(0)
    for _ in range(d - rank):
        o.f(1)
        o.i(1, weight=True)
    while o.forwards[1] < t:
        if o.forwards[0] < t:
            o.f(0)
        o.i(0, weight=True)
        o.f(1)
        o.i(1, weight=True)
    # Drain: deferring W lets each I pass the input gradient on at once; the W's
    # fill the gaps while the last microbatches come back up the V.
    o.i(0, weight=False)
    for _ in range(rank):
        o.i(1, weight=False)
        o.i(0, weight=False)
    while o.backwards[0] < t:
        o.w()
        o.i(0, weight=False)
    return o.row + list(o.pending)


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V: 2 chunks per rank in a V; zero bubble at f = b = w (T >= 2D-1), D M_a per rank.

    Args:
        num_stages: D, ranks (each holds 2 of the 2D parts).
        num_microbatches: T, any T >= 1 (zero bubble needs T >= 2D-1).

    Raises:
        ScheduleError: a value below 1.

    Example:
        >>> [str(a) for a in zb_v(1, 1).actions[0]]
        ['0F0', '1F0', '1I0', '1W0', '0I0', '0W0', '0U0', '1U0']
    """
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    d, t = num_stages, num_microbatches
    full = max(t, 2 * d - 1)  # the phases need 2D-1 microbatches to fill the V
    placement = Placement.vshape(d)
    rows = [[a for a in zb_v_order(r, d, full) if a.microbatch < t] for r in range(d)]
    append_updates(rows, placement)
    return Schedule("zb-v", placement, t, tuple(map(tuple, rows)))
