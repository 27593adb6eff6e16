"""The timeline as one compiled walk (numba): the fast engine for large schedules.

``sim.rounds`` times a schedule in rounds of numpy calls, one action per rank
per round; its cost is a dozen calls per round plus the arrays it builds. This
module does the same in a single pass compiled by numba: each rank runs its
row until an input from another rank is missing, parks on the action that will
make it, and is taken up again when that action ends (the reference walk of
``schedule.dataflow``, in its order). Every time is computed by the same float
operations as the reference (one addition per edge, a maximum), so the result
is the reference's bit for bit (tests/sim/test_fast.py).

Loading it costs about half a second once per process (importing numba, and
the kernel from numba's cache on disk; compiling it the first time after an
install, about 2 s), so ``sim.rounds.fast_times`` sends only schedules of
``sim.rounds.COMPILED_FROM`` actions or more here (benchmarks/simulator/README.md).
"""

from __future__ import annotations

import numba
import numpy as np
from numpy.typing import NDArray

from pipeweave.sim.arrays import B, F, I, ScheduleArrays, W

FloatArray = NDArray[np.float64]

DONE, UNORDERED, DEADLOCK = 0, 1, 2
"""The kernel's outcomes: every action timed; an input from the action's own rank comes later in its row;
some rank cannot go on (both left to the reference, which explains them)."""


@numba.njit(cache=True, nogil=True, inline="always")
def _input(made, neighbour, s, j, k, t, stage_rank):  # type: ignore[no-untyped-def]  # noqa: ANN001
    """The action on another rank that action k (of stage s, microbatch j) waits for: ``made``'s entry of the
    ``neighbour`` stage; -1 where there is none (no neighbour, or one on the same rank, made earlier in the
    row: a V's turn), -2 where it is never made, -3 where the same rank makes it later (``UNORDERED``)."""
    if neighbour < 0:
        return -1
    src = made[neighbour * t + j]
    if stage_rank[neighbour] == stage_rank[s]:
        return -1 if 0 <= src < k else -3
    return src if src >= 0 else -2


@numba.njit(cache=True, nogil=True)
def _walk(  # type: ignore[no-untyped-def]  # one flat loop, for speed
    offsets,
    stops,
    stage,
    op,
    microbatch,
    cell,
    width,
    extra,
    prev,
    nxt,
    stage_rank,
    hop_prev,
    hop_next,
    has_latency,
    t,
    gap,
    start,
    end,
    walked,
):  # noqa: ANN001
    """Fill ``start`` and ``end`` (and ``walked``: per action, its place in the walk) of the actions before each
    rank's stop; return ``DONE``, ``UNORDERED`` or ``DEADLOCK``."""
    n = stage.shape[0]
    num_ranks = offsets.shape[0] - 1
    made_f = np.full(prev.shape[0] * t, -1, np.int32)  # per (stage, microbatch): its F (int32: fewer fresh pages)
    made_g = np.full(prev.shape[0] * t, -1, np.int32)  # ... and its B or I
    for k in range(n):
        if op[k] == F:
            made_f[stage[k] * t + microbatch[k]] = k
        elif op[k] == B or op[k] == I:
            made_g[stage[k] * t + microbatch[k]] = k
    # The walk: ranks taken up in the reference's order (a queue), each run until an input from another
    # rank is missing; it parks on the action that makes it. An input from its own rank must come earlier.
    ptr = offsets[:-1].copy()
    waiter = np.full(n, -1, np.int32)  # per action, the rank parked on it
    queue = np.empty(n + num_ranks, np.int32)  # a rank is queued once at the start, then once per wake-up
    head = tail = 0
    for r in range(num_ranks):
        if ptr[r] < stops[r]:
            queue[tail] = r
            tail += 1
    count = 0
    while head < tail:
        r = queue[head]
        head += 1
        k = ptr[r]
        while k < stops[r]:
            s, j, o = stage[k], microbatch[k], op[k]
            src = -1  # the action on another rank whose end this one waits for (-2: one never made)
            hop = 0.0
            if o == F:
                src = _input(made_f, prev[s], s, j, k, t, stage_rank)
                if src >= 0 and has_latency:
                    hop = hop_prev[s]
            elif o == B or o == I:
                if not 0 <= made_f[s * t + j] < k:  # its own F
                    return UNORDERED
                src = _input(made_g, nxt[s], s, j, k, t, stage_rank)
                if src >= 0 and has_latency:
                    hop = hop_next[s]
            elif o == W and not 0 <= made_g[s * t + j] < k:  # its own I
                return UNORDERED
            if src == -3:
                return UNORDERED
            if src == -2:
                break  # never made: a deadlock, found below
            t0 = -np.inf
            if src >= 0:
                t0 = end[src]
                if t0 == np.inf:  # not yet timed: park on it
                    waiter[src] = r
                    break
                if has_latency:
                    t0 = t0 + hop
            ready = 0.0
            if k > offsets[r]:
                ready = end[k - 1] + gap if gap else end[k - 1]
            m = ready if ready > t0 else t0
            duration = cell[s * width + o]
            if extra.shape[0]:
                duration = duration + extra[k]
            start[k] = m
            end[k] = m + duration
            walked[k] = count
            count += 1
            if waiter[k] >= 0:
                queue[tail] = waiter[k]
                tail += 1
            k += 1
        ptr[r] = k
    for r in range(num_ranks):
        if ptr[r] != stops[r]:
            return DEADLOCK
    return DONE


def walk_times(
    arrays: ScheduleArrays,
    stops: NDArray[np.integer],
    durations: FloatArray,
    *,
    neighbours: tuple[NDArray[np.int64], NDArray[np.int64]],
    stage_rank: NDArray[np.int64],
    hops: tuple[FloatArray, FloatArray] | None,
    gap: float,
    extra: FloatArray | None,
    num_microbatches: int,
) -> tuple[FloatArray, FloatArray, NDArray[np.int64]] | None:
    """Start, end and place in the walk of every action before its rank's stop (``sim.rounds._loop_ends``;
    the others are left at inf, inf and -1); None where the reference must explain the schedule.

    Args:
        arrays: a well-formed schedule's ``sim.arrays.schedule_arrays``.
        stops: per rank, the index where the actions timed here end.
        durations: per stage and op code, the op's time (shape ``(num_stages, 5)``).
        neighbours: per stage, its previous and its next stage (-1: none).
        stage_rank: per stage, its rank.
        hops: per stage, the message time from its previous and from its next stage (None: no latency).
        gap: the dispatch gap between two actions of a rank.
        extra: per action, time added to its duration (None: none).
        num_microbatches: the schedule's T.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.arrays import schedule_arrays
        >>> s = generate("gpipe", num_stages=2, num_microbatches=2)
        >>> a = schedule_arrays(s)
        >>> start, end, _ = walk_times(a, a.offsets[1:] - 1, np.ones((2, 5)), neighbours=(np.array([-1, 0]),
        ...     np.array([1, -1])), stage_rank=np.array([0, 1]), hops=None, gap=0.0, extra=None, num_microbatches=2)
        >>> end[:4].tolist(), end[5:9].tolist()
        ([1.0, 2.0, 5.0, 6.0], [2.0, 3.0, 4.0, 5.0])
    """
    n = arrays.size
    start, end = np.full(n, np.inf), np.full(n, np.inf)
    walked = np.full(n, -1, dtype=np.int64)
    no_hops = np.zeros(len(stage_rank))
    hop_prev, hop_next = hops if hops is not None else (no_hops, no_hops)
    outcome = _walk(
        arrays.offsets,
        stops.astype(np.int64),
        arrays.stage,
        arrays.op,
        arrays.microbatch,
        np.ascontiguousarray(durations, dtype=np.float64).ravel(),
        durations.shape[1],
        extra if extra is not None else np.zeros(0),
        *neighbours,
        stage_rank,
        hop_prev,
        hop_next,
        hops is not None,
        num_microbatches,
        float(gap),
        start,
        end,
        walked,
    )
    return (start, end, walked) if outcome == DONE else None
