"""ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward is split into ``I`` (input gradient, the paper's B) and ``W``
(weight gradient). ``I`` is on the critical path between stages; ``W`` is not,
so it is deferred into the bubbles. Legend: D ranks, T microbatches, f, b, w
the per-stage times of F, I and W. Rank r (0-based) of D:

- ZB-H1 warms up with D-r-1 forwards like 1F1B, then runs ``F I`` pairs with
  each ``W`` held back by r microbatches (so r W's are pending), then drains
  ``I W`` pairs and the pending W's. Same activation memory as 1F1B.
- ZB-H2 warms up with 2(D-r)-2 forwards, which fill the time until the first
  input gradient comes back, then the same steady and drain phases with W
  held back by 2r. D = 2, T = 3::

    ZB-H1  rank 0 | 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2
           rank 1 | 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
    ZB-H2  rank 0 | 0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2
           rank 1 | 1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2

Closed forms, uniform per-stage costs, no communication. "Bubble time" is the
max over ranks of span - busy (busy is (f+b+w) T on every rank):

- ZB-H1: (D-1)(f+b-w) exactly when T >= D and w <= f (for any b).
- ZB-H2: (D-1)(f+b-2w) exactly when T >= 2D-1, w <= f and 2w <= f+b;
  0 at f = b = w. With 2w > f+b (still w <= f) it is 0: the form is
  max(0, (D-1)(f+b-2w)) for T >= 2D-1 and w <= f.

(The order is fixed by D and T alone, so a W longer than F shows up as extra
idle time; the simulator checks these conditions on D 1..8, T 1..24.)
Activations, with the cost model's accounting (M_a from F, (1 - mem_w) M_a
released by I, the M_W = mem_w M_a rest by W), rank r holds at peak
(D-r) M_a + r M_W under ZB-H1 (T >= D) and (2D-2r-1) M_a + 2r M_W under ZB-H2
(T >= 2D-1): the paper's per-worker figures with worker i = r+1; rank 0 peaks
at D M_a and (2D-1) M_a. Any T >= 1 is accepted; below those T the schedules
stay valid, with fewer microbatches in flight and more bubble.
"""

from __future__ import annotations

from collections import deque

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, append_updates, check_positive


def split_backward_order(stage: int, num_microbatches: int, warmup: int, lag: int) -> list[Action]:
    """One rank's order: ``warmup`` forwards, ``F I`` pairs with W lagging by ``lag``, drain.

    Example:
        >>> [str(a) for a in split_backward_order(0, 3, warmup=1, lag=0)]
        ['0F0', '0F1', '0I0', '0W0', '0F2', '0I1', '0W1', '0I2', '0W2']
    """
    t = num_microbatches
    warmup = min(warmup, t)
    row = [Action(stage, Op.F, j) for j in range(warmup)]
    pending: deque[Action] = deque()

    def backward(j: int, weight: bool) -> None:
        row.append(Action(stage, Op.I, j))
        pending.append(Action(stage, Op.W, j))
        if weight:
            row.append(pending.popleft())

    for k in range(t - warmup):
        row.append(Action(stage, Op.F, warmup + k))
        backward(k, weight=k >= lag)  # the first `lag` W's wait: they fill the drain's bubbles
    for j in range(t - warmup, t):
        backward(j, weight=True)
    return row + list(pending)


def _zero_bubble(name: str, num_stages: int, num_microbatches: int, h2: bool) -> Schedule:
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    d = num_stages
    placement = Placement.straight(d)
    rows = []
    for r in range(d):
        # ZB-H2 doubles both the in-flight forwards and the deferred W's of ZB-H1.
        warmup, lag = (2 * (d - r) - 2, 2 * r) if h2 else (d - r - 1, r)
        rows.append(split_backward_order(r, num_microbatches, warmup, lag))
    append_updates(rows, placement)
    return Schedule(name, placement, num_microbatches, tuple(map(tuple, rows)))


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's memory, bubble (D-1)(f+b-w) (T >= D, w <= f).

    Args:
        num_stages: D, ranks (one stage each).
        num_microbatches: T, any T >= 1.

    Raises:
        ScheduleError: a value below 1.

    Example:
        >>> [str(a) for a in zb_h1(2, 3).actions[1]]
        ['1F0', '1I0', '1F1', '1I1', '1W0', '1F2', '1I2', '1W1', '1W2', '1U0']
    """
    return _zero_bubble("zb-h1", num_stages, num_microbatches, h2=False)


def zb_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2: (2D-1) M_a on rank 0, bubble max(0, (D-1)(f+b-2w)) (T >= 2D-1, w <= f).

    Args:
        num_stages: D, ranks (one stage each).
        num_microbatches: T, any T >= 1.

    Raises:
        ScheduleError: a value below 1.

    Example:
        >>> [str(a) for a in zb_h2(2, 3).actions[0]]
        ['0F0', '0F1', '0F2', '0I0', '0W0', '0I1', '0W1', '0I2', '0W2', '0U0']
    """
    return _zero_bubble("zb-h2", num_stages, num_microbatches, h2=True)
