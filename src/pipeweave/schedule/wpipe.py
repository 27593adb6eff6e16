"""WPipe (Yang et al., ICLR 2022): group-based interleaved pipelining with double-grouped weight updates.

The model is cut into 2D parts in two groups; rank r holds part r of the first
group (parts 0..D-1) and part D + r of the second (parts D..2D-1): the looped
placement with two chunks. Both groups update once per period of T
microbatches and alternately, at different times. In the first group the
forwards of the next period move ahead of the backwards of the current one
(their gradients lag one version; backwards read the version their forward
read, double-buffered: policy DOUBLE_BUFFER); the second group keeps the
synchronous order (a stage starts the next period's forwards after its update),
so its gradients are never stale. Half the stale gradients and weight copies of
PipeDream-2BW, as the paper argues.

The order comes from ``stream.greedy_stream`` at f = 1, B = 2 (the paper gives
no per-rank order we could transcribe); a first-group stage at position i keeps
at most min(3D - i, T) microbatches in flight, a second-group one 2D - i. Its
steady-state bubble is not the paper's ~0 at small T: measured at f = b = w,
D = 4: 0.23 (T = 4), 0.10 (T = 8), 0.02 (T = 16) (tests/schedule/test_asynchronous.py).
"""

from __future__ import annotations

from pipeweave.schedule.ir import Placement, Schedule, WeightPolicy
from pipeweave.schedule.stream import DEFAULT_NUM_STEPS, add_updates, check_stream, every, greedy_stream


def wpipe(num_stages: int, num_microbatches: int, *, num_steps: int = DEFAULT_NUM_STEPS) -> Schedule:
    """WPipe's stream on D ranks, 2 chunks per rank, the two groups updating alternately.

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
    placement = Placement.looped(d, 2)
    route = placement.pipelines[0]

    def second_group_in_order(stage: int, j: int, backwards_done: int) -> bool:
        # The second group finishes a period (and its update) before the next one's forwards.
        return stage < d or backwards_done >= (j // t) * t

    def bound(stage: int) -> int:
        # First group: deep enough to cover the 2D-stage round trip, but at most T in
        # flight so its microbatches span two versions (double buffer); second: 1F1B's.
        return min(3 * d - stage, t) if stage < d else 2 * d - stage

    rows = greedy_stream(placement, [route] * total, bound, second_group_in_order)
    rows = add_updates(rows, every(t, total))
    return Schedule(
        "wpipe", placement, total, tuple(map(tuple, rows)), policy=WeightPolicy.DOUBLE_BUFFER, num_steps=num_steps
    )
