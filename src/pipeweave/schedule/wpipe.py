"""WPipe (Yang et al., ICLR 2022): group-based interleaved pipelining with double-grouped weight updates (2GW).

The model is cut into 2D parts in two groups; rank r holds part r of the first
group G0 (parts 0..D-1) and part D + r of the second G1 (parts D..2D-1): the
looped placement with two chunks. Both groups update once per period of T
microbatches, alternately. The paper's "moving" operation: in G0 the forwards
of period k + 1 run before the backwards of period k (their gradients lag one
version; a backward reads the version its forward read, double-buffered:
policy DOUBLE_BUFFER); G1 keeps the synchronous order (a stage starts period
k + 1's forwards after its update k), so its gradients are never stale. Half
the stale gradients and weight copies of PipeDream-2BW, as the paper argues.

The order is written by rule. G1 runs period k as a 1F1B pipeline over the D
ranks, and G0's work fills its gaps. Rank r's list for period k (n = min(T, D - r)
G1 forwards before its first G1 backward, as 1F1B's warm-up; ``F0``/``B0`` are G0's,
``F1``/``B1`` G1's, ``i`` the microbatch within period k)::

    F1 i=0  B0  F1 i=1  B0 ... F1 i=n-1           G1 warm-up, a G0 backward in each gap
    B1 i  F1 i+n            for i < T - n         G1 steady 1F1B
    B1 i  F0                for i >= T - n        G1 cool-down, a G0 forward in each gap
    (F0  B0) x (T - n + 1)                        G0 alone

The G0 forwards are period k + 1's microbatches, in order (the moved forwards);
the G0 backwards are microbatches k T - (D - 1 - r), k T - (D - 1 - r) + 1, ...
(rank r's G0 backward of a microbatch comes D - 1 - r slots after rank D - 1's).
At f = 1, B = 2 and T >= D no rank ever waits in the steady state: the
steady-state bubble is 0, the paper's ~0 (``sim.steady``; tests/schedule/
test_asynchronous.py checks D, T up to 8), with two versions of G0, one of G1.
With T < D (outside the paper's setting) a period is shorter than G0's round
trip and the moved forwards would need a third version: the order is then
list-scheduled under 2GW's rules (``_short_periods``), with a bubble.

Example, D = T = 2 (stages 0, 1 are G0, stages 2, 3 G1), period 1's lists::

    rank 0 | 2F2 0B1 2F3 2B2 0F4 2B3 0F5 0B2
    rank 1 | 3F2 3B2 3F3 3B3 1F4 1B2 1F5 1B3
"""

from __future__ import annotations

from collections.abc import Iterator

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, WeightPolicy
from pipeweave.schedule.stream import DEFAULT_NUM_STEPS, add_updates, check_stream, every, greedy_stream

_F0, _B0 = "F0", "B0"  # a G0 slot in a period's list, filled by ``_rank_row``


def period_slots(num_stages: int, num_microbatches: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s list for one period: ``("F1" | "B1", i)`` for G1's microbatch i, ``("F0" | "B0", x)`` for
    its x-th G0 forward or backward slot (the module docstring's picture).

    Example:
        >>> [f"{k}{i}" for k, i in period_slots(2, 2, 0)]
        ['F10', 'B00', 'F11', 'B10', 'F00', 'B11', 'F01', 'B01']
    """
    d, t = num_stages, num_microbatches
    n = min(t, d - rank)
    out: list[tuple[str, int]] = []
    for i in range(n):  # warm-up: G1 forwards, a G0 backward between two
        out.append(("F1", i))
        if i < n - 1:
            out.append((_B0, i))
    for i in range(t - n):  # steady 1F1B of G1
        out += [("B1", i), ("F1", i + n)]
    for x, i in enumerate(range(t - n, t)):  # cool-down: G1 backwards, a G0 forward between two
        out.append(("B1", i))
        if i < t - 1:
            out.append((_F0, x))
    forwards, backwards = n - 1, n - 1
    for x in range(t - n + 1):  # G0 alone
        out += [(_F0, forwards + x), (_B0, backwards + x)]
    return out


def _rank_row(d: int, t: int, rank: int, total: int) -> Iterator[Action]:
    """Rank ``rank``'s whole stream: its period list for k = -1, 0, ..., drained, microbatches numbered globally."""
    lag = d - 1 - rank  # its G0 backwards run this many slots behind rank D - 1's
    slots = period_slots(d, t, rank)
    for k in range(-1, total // t + d + 1):
        for kind, x in slots:
            if kind == _F0:
                a = Action(rank, Op.F, (k + 1) * t + x)  # the next period's forwards, moved ahead
            elif kind == _B0:
                a = Action(rank, Op.B, k * t + x - lag)
            else:
                a = Action(d + rank, Op.F if kind == "F1" else Op.B, k * t + x)
            if 0 <= a.microbatch < total:
                yield a


def _short_periods(d: int, t: int, total: int) -> list[list[Action]]:
    """T < D: a period is shorter than G0's round trip, and the rule's moved forwards would need a third version.
    The order is then list-scheduled at f = 1, B = 2 (``stream.greedy_stream``) under 2GW's two rules: G1
    starts a period after its update, G0 at most min(3D - s, T) microbatches in flight at stage s (two versions).
    """
    placement = Placement.looped(d, 2)

    def second_group_in_order(stage: int, j: int, backwards_done: int) -> bool:
        return stage < d or backwards_done >= (j // t) * t

    def bound(stage: int) -> int:
        return min(3 * d - stage, t) if stage < d else 2 * d - stage

    return greedy_stream(placement, [placement.pipelines[0]] * total, bound, second_group_in_order)


def wpipe(num_stages: int, num_microbatches: int, *, num_steps: int = DEFAULT_NUM_STEPS) -> Schedule:
    """WPipe's 2GW stream on D ranks, 2 chunks per rank, the two groups updating alternately.

    Args:
        num_stages: D, the number of ranks (the pipeline has 2D stages).
        num_microbatches: T, microbatches per period (mini-batch).
        num_steps: periods in the stream (default 4).

    Example:
        >>> s = wpipe(2, 2, num_steps=2)
        >>> s.num_stages, s.placement.stage_rank, s.policy
        (4, (0, 1, 0, 1), <WeightPolicy.DOUBLE_BUFFER: 'double-buffer'>)
    """
    check_stream(num_stages, num_microbatches, num_steps)
    d, t = num_stages, num_microbatches
    total = num_steps * t
    rows = [list(_rank_row(d, t, r, total)) for r in range(d)] if t >= d else _short_periods(d, t, total)
    rows = add_updates(rows, every(t, total))
    return Schedule(
        "wpipe",
        Placement.looped(d, 2),
        total,
        tuple(map(tuple, rows)),
        policy=WeightPolicy.DOUBLE_BUFFER,
        num_steps=num_steps,
    )
