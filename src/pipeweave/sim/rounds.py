"""The timeline in rounds over numpy arrays: the fast twin of ``schedule.dataflow``'s in-order walk.

Each round, every rank looks at its next action; if the action's input from
another rank has been computed, the action runs: it starts at the later of its
rank's previous end (plus the dispatch gap) and that input's end (plus the
hop), and ends its duration later. One round is a dozen numpy calls over the
ranks, whatever D is; the number of rounds is about the longest rank's length
plus the pipeline's depth.

The result is bit for bit the reference's (tests/sim/test_fast.py): every
time is computed by the same float operations (one addition per edge, a
maximum), only in another order, and floats' order of evaluation matters only
within a sum, never across a maximum. A prefix-sum formulation would be faster
but would round differently.

Inputs produced on the same rank need no time (they ended before the rank's
previous action did); they only need to come earlier in the row, which is
checked up front. A data-parallel reduction (``update_delay``) of a part held
on two ranks runs, in the reference, on the stream of whichever rank it walked
last to the part's last weight gradient; for those, ``_Loop.walk`` times the
schedule in the reference's own order instead of the rounds. What neither
covers, the caller leaves to the reference: schedules that fail
``check_actions``, a synchronous ``U`` before other work on its rank, and an
asynchronous schedule with data-parallel reductions.

Schedules of ``COMPILED_FROM`` actions or more go to ``sim.compiled``'s walk
instead, the same walk compiled; the checks, the updates and the reductions
around it are this module's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from pipeweave.schedule.ir import Placement, Schedule
from pipeweave.schedule.round_robin import averages_replicas
from pipeweave.sim.arrays import B, F, I, ScheduleArrays, U, W

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.integer]  # int32 or int64 (sim.arrays)
Latency = Callable[[int, int], float]
_CHECK_EVERY = 32  # rounds between checks for the end (or a deadlock: a round where no rank moved)
MIN_PER_ROUND = 12.0
"""Actions per round below which the rounds give way to ``_Loop.walk``: a round of numpy calls costs
about what that Python walk spends on 11-15 actions (5.3 microseconds against 0.35-0.5 per action,
benchmarks/simulator/README.md). Schedules that keep few ranks busy at a time (naive, GEMS) have
about one action per round."""
_TRIAL_ROUNDS = 256  # rounds before that rate is judged
COMPILED_FROM = 50_000
"""Actions from which ``fast_times`` takes the compiled walk (``sim.compiled``) rather than the rounds. Loading
it costs about 0.4 s once per process (numba's import and cache); at D = 64, T = 512 (65,600-196,736 actions)
the rounds cost 23-61 ms a schedule cold against the walk's 14-39 ms (benchmarks/simulator/README.md): one
such simulation loses, a plan, a search or a compare that simulates tens of them gains. Below it, a run's
own schedules (``train``'s estimates in every rank) never load numba."""
Engine = Literal["auto", "rounds", "compiled"]


def fast_times(
    schedule: Schedule,
    arrays: ScheduleArrays,
    durations: FloatArray,
    *,
    latency: Latency | None,
    gap: float,
    update_delay: Sequence[float] | None,
    min_per_round: float = MIN_PER_ROUND,
    extra: FloatArray | None = None,
    engine: Engine = "auto",
) -> tuple[FloatArray, FloatArray] | None:
    """Start and end of every action (in ``arrays``' order), or None where the reference must do it.

    Args:
        schedule: the schedule ``arrays`` encodes.
        arrays: its ``sim.arrays.schedule_arrays``.
        durations: per stage and op code, the op's time (shape ``(num_stages, 5)``).
        latency, gap, update_delay: as ``schedule.dataflow.execute``'s.
        min_per_round: when, after 256 rounds, fewer actions than this ran per round, go on one
            action at a time in Python (``_Loop.walk``); inf: after the first 32 rounds.
        extra: per action (in ``arrays``' order), time added to its duration (memory actions folded
            into their neighbours, ``sim.levers``); U takes none.
        engine: "rounds" (this module), "compiled" (``sim.compiled``'s walk), or "auto": compiled from
            ``COMPILED_FROM`` actions on. All give the same times.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.arrays import schedule_arrays
        >>> s = generate("gpipe", num_stages=2, num_microbatches=2)
        >>> start, end = fast_times(s, schedule_arrays(s), np.ones((2, 5)), latency=None, gap=0.0, update_delay=None)
        >>> end[:5].tolist()
        [1.0, 2.0, 5.0, 6.0, 7.0]
    """
    delay = update_delay if update_delay is not None and any(update_delay) else None
    sync = schedule.is_synchronous
    if not arrays.ok or (delay is not None and not sync) or averages_replicas(schedule):
        return None  # the in-order walk (``schedule.dataflow``): 1F1B-RR's replicas meet at every U
    stops = _loop_ends(arrays, sync)
    if stops is None:
        return None
    # A part held on two ranks reduces on the stream of the rank the reference walks last to it:
    # only a walk in the reference's own order (``_Loop.walk`` from the start, or the compiled walk) knows which.
    ordered_walk = delay is not None and _replicated(schedule)
    walked: IntArray | None = None
    if engine == "compiled" or (engine == "auto" and arrays.size >= COMPILED_FROM):
        found = _compiled(schedule, arrays, stops, durations, latency, gap, extra)
        if found is None:
            return None
        start, end, order_of = found
        walked = order_of if ordered_walk else None
    else:
        loop = _Loop(schedule, arrays, stops, durations, latency, gap, extra)
        order: list[int] | None = [] if ordered_walk else None
        if not loop.ordered or not (loop.walk(order) if order is not None else loop.run(min_per_round)):
            return None
        start, end = loop.times()  # a synchronous schedule's U are timed next
        if order is not None:  # per action, when the walk timed it (-1: a U, never walked)
            seen = np.full(len(loop.end), -1, dtype=np.int64)
            seen[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
            walked = seen[loop.slots(np.arange(arrays.size))]
    if sync and not _run_updates(schedule, arrays, durations, gap, delay, start, end, walked):
        return None
    return start, end


def _compiled(
    schedule: Schedule,
    arrays: ScheduleArrays,
    stops: IntArray,
    durations: FloatArray,
    latency: Latency | None,
    gap: float,
    extra: FloatArray | None,
) -> tuple[FloatArray, FloatArray, IntArray] | None:
    """``sim.compiled.walk_times`` on the schedule's neighbours and hops (numba: loaded by the first call)."""
    from pipeweave.sim.compiled import walk_times

    placement = schedule.placement
    prev, nxt = _neighbours(placement)
    stage_rank = np.asarray(placement.stage_rank, dtype=np.int64)
    hops = None if latency is None else (_hops(latency, prev, stage_rank), _hops(latency, nxt, stage_rank))
    return walk_times(
        arrays,
        stops,
        durations,
        neighbours=(prev, nxt),
        stage_rank=stage_rank,
        hops=hops,
        gap=gap,
        extra=extra,
        num_microbatches=schedule.num_microbatches,
    )


def _replicated(schedule: Schedule) -> bool:
    """Some part has stages on two ranks (Chimera, GEMS, DualPipe)."""
    placement = schedule.placement
    ranks: dict[int, int] = {}
    return any(ranks.setdefault(part, rank) != rank for part, rank in zip(placement.stage_part, placement.stage_rank))


def _loop_ends(arrays: ScheduleArrays, sync: bool) -> IntArray | None:
    """Per rank, where (an index into ``arrays``) the actions the rounds time end: its row's end, or for a
    synchronous schedule its first ``U``, after which all its actions must be ``U`` (the registry's
    synchronous schedules are so; None where not)."""
    ends = arrays.offsets[1:]
    if not sync:
        return ends
    updates = np.flatnonzero(arrays.op == U)
    ranks = arrays.rank[updates]
    stops = ends - np.bincount(ranks, minlength=len(ends))
    return stops if bool((updates >= stops[ranks]).all()) else None  # distinct, so they fill each row's tail


class _Loop:
    """The rounds' arrays: the ranks' rows one after another, each between two sentinel slots.

    Slot ``k + 2 r + 1`` holds action k (of rank r); the slot before a row ends
    at ``-gap`` (so that its first action starts at 0 with the gap added); the
    row's first slot not timed here (its first ``U``, for a synchronous
    schedule, else the slot after the row) waits on ``never`` (never computed:
    the rank stops there). ``none`` ends at -inf: the input of an action that
    needs none from another rank. It is built with few and small temporaries:
    on the machine of benchmarks/simulator/README.md fresh memory costs more
    than the work done in it.
    """

    def __init__(
        self,
        schedule: Schedule,
        arrays: ScheduleArrays,
        stops: IntArray,
        durations: FloatArray,
        latency: Latency | None,
        gap: float,
        extra: FloatArray | None = None,
    ) -> None:
        n, num_ranks = arrays.size, schedule.num_ranks
        size = n + 2 * num_ranks
        self.gap = gap
        self.rank = arrays.rank
        skip = 2 * np.arange(num_ranks)
        first = arrays.offsets[:-1] + skip  # the sentinel before each row
        self.rows = list(zip((first + 1).tolist(), (arrays.offsets[1:] + skip + 1).tolist()))  # its slots
        self.spans = list(zip(arrays.offsets[:-1].tolist(), arrays.offsets[1:].tolist()))  # its actions
        self.none, self.never = size, size + 1
        self.ptr = first + 1
        self.trail = stops + skip + 1
        self.base = np.full(size + 3, np.inf)  # base[k + 1] is slot k's end; base[0] stands before slot 0
        self.end = self.base[1:]
        self.end[first] = -gap if gap else 0.0
        self.end[self.none] = -np.inf
        cell = arrays.stage.astype(np.intp)  # (stage, op) in ``durations`` flattened
        cell *= durations.shape[1]
        cell += arrays.op
        self.duration = np.zeros(size + 2)
        took = durations.ravel().take(cell) if extra is None else durations.ravel().take(cell) + extra
        del cell
        self._spread(took, self.duration)
        self.dep = np.full(size + 2, self.none, dtype=np.intp)
        self.dep[self.trail] = self.never
        self.latency = np.zeros(size + 2) if latency is not None else None
        self.ordered = self._inputs(schedule, arrays, latency)

    def _inputs(self, schedule: Schedule, arrays: ScheduleArrays, latency: Latency | None) -> bool:
        """Fill ``dep`` (and ``latency``) with each action's input from another rank; False when an
        input from its own rank comes later in the row (the reference then explains the deadlock)."""
        placement, t = schedule.placement, schedule.num_microbatches
        num_stages = placement.num_stages
        stage_rank = np.asarray(placement.stage_rank, dtype=np.int64)
        prev, nxt = _neighbours(placement)
        stage, op, mb, slot = arrays.stage, arrays.op, arrays.microbatch, self.slots
        f, b, i, w = (np.flatnonzero(op == code) for code in (F, B, I, W))
        g = np.concatenate((b, i)) if b.size and i.size else (b if b.size else i)  # B or I: the backward's input
        made_f = np.full(num_stages * t, self.never, dtype=np.intp)  # slot of F(s, j) at s * T + j
        made_f[_keys(stage[f], mb[f], t)] = slot(f)
        made_g = np.full(num_stages * t, self.never, dtype=np.intp)  # slot of B(s, j) or I(s, j)
        made_g[_keys(stage[g], mb[g], t)] = slot(g)
        # An own-rank input must come earlier in the row: F before its B/I, I before its W (a W's
        # (stage, microbatch) has an I, never a B: ``well_formed``).
        ordered = bool(
            (made_f[_keys(stage[g], mb[g], t)] < slot(g)).all() and (made_g[_keys(stage[w], mb[w], t)] < slot(w)).all()
        )
        for idx, made, neighbour in ((f, made_f, prev), (g, made_g, nxt)):
            has = neighbour >= 0
            across = has & (stage_rank[neighbour] != stage_rank)  # per stage: its input comes from another rank
            s = stage[idx]
            if (has & ~across).any():  # inputs from the same rank (a V's turn): made earlier in the row
                near = idx[(has & ~across)[s]]
                ordered &= bool((made[_keys(neighbour[stage[near]], mb[near], t)] < slot(near)).all())
            cross = across[s]
            idx, s = idx[cross], s[cross]
            slots = slot(idx)
            self.dep[slots] = made[_keys(neighbour[s], mb[idx], t)]
            if self.latency is not None and latency is not None:
                self.latency[slots] = _hops(latency, neighbour, stage_rank)[s]
        return ordered

    def run(self, min_per_round: float) -> bool:  # one flat loop, for speed
        """The rounds; False on a deadlock (a round in which no rank moved). With too few actions per
        round, ``walk`` goes on from where the rounds are."""
        end, dep, duration, latency = self.end, self.dep, self.duration, self.latency
        before, gap, ptr, trail, inf = self.base, self.gap, self.ptr, self.trail, np.inf
        # Bound methods and plain ufunc calls (no ``out=``): about 6 % of zb-v's rounds at D = 64.
        take_end, take_dep, take_before, take_duration, put = end.take, dep.take, before.take, duration.take, end.put
        maximum, add, less = np.maximum, np.add, np.less
        moved, rounds, first = -1, 0, int(ptr.sum())
        while True:
            for _ in range(_CHECK_EVERY):
                t0 = take_end(take_dep(ptr))
                if latency is not None:
                    t0 = add(t0, latency.take(ptr))
                ready = take_before(ptr)  # the end of the rank's previous action
                if gap:
                    ready = add(ready, gap)
                t0 = add(maximum(t0, ready), take_duration(ptr))
                put(ptr, t0)
                ptr += less(t0, inf)
            if (ptr == trail).all():
                return True
            total = int(ptr.sum())
            if total == moved:
                return False
            moved, rounds = total, rounds + _CHECK_EVERY
            judged = rounds == _TRIAL_ROUNDS or min_per_round == math.inf  # inf: walk at once (tests)
            if judged and total - first < min_per_round * rounds:
                return self.walk()

    def walk(self, order: list[int] | None = None) -> bool:  # one flat loop, for speed
        """The rest of the schedule one action at a time in Python, over the same arrays and by the
        same operations as the rounds: for schedules that keep about one rank busy at a time, whose
        timeline is a chain no round can shorten. A rank runs until its next input is missing and
        parks on the slot that will make it; False on a deadlock. Started before any round, it takes
        the ranks in the reference walk's order (``schedule.dataflow``'s queue), which ``order``
        then receives, one slot per action timed."""
        end, dep, duration = self.end.tolist(), self.dep.tolist(), self.duration.tolist()
        latency = self.latency.tolist() if self.latency is not None else None
        gap, inf = self.gap, math.inf
        waiter = [0] * len(end)  # per slot, the slot parked on it (0: none; slot 0 is a sentinel, never parked)
        record = order.append if order is not None else None
        # A rank is the slot it is at: it stops at its trail, whose input (``never``) is never made.
        queue = deque(self.ptr[self.ptr < self.trail].tolist())
        k = queue.popleft() if queue else self.never
        while k != self.never:
            source = dep[k]
            t0 = end[source]
            if t0 == inf:  # park on the input's slot (one slot waits on another at most: ``_inputs``)
                waiter[source] = k
                k = queue.popleft() if queue else self.never
                continue
            if latency is not None:
                t0 += latency[k]
            ready = end[k - 1] + gap if gap else end[k - 1]
            end[k] = (ready if ready > t0 else t0) + duration[k]
            if record is not None:
                record(k)
            w = waiter[k]
            k += 1
            if w:  # a rank waited on this action
                if record is None and end[dep[k]] == inf:  # and this rank cannot go on: switch at once
                    waiter[dep[k]] = k  # (a walk recording the reference's order keeps its queue's order)
                    k = w
                else:
                    queue.append(w)
        self.end[:] = end
        return bool((self.end[self.trail - 1] < inf).all())  # each row's last timed slot (an empty one's sentinel)

    def times(self) -> tuple[FloatArray, FloatArray]:
        """Start and end of every action, in order: each start is recomputed from the ends, by the
        rounds' own operations (the loop keeps only the ends); a synchronous schedule's U are not
        timed here (``_run_updates``)."""
        start = self.end.take(self._rows(self.dep))
        if self.latency is not None:
            start += self._rows(self.latency)
        ready = self._rows(self.base)  # base[k] is slot k - 1's end
        if self.gap:
            ready += self.gap
        np.maximum(start, ready, out=start)
        return start, self._rows(self.end)

    def slots(self, actions: IntArray) -> IntArray:
        """The slots of these actions (indices into the schedule's arrays): ``k + 2 r + 1``, computed
        where needed rather than kept for every action (fresh memory is dear, the class docstring)."""
        slot = self.rank[actions].astype(np.intp)
        slot *= 2
        slot += actions
        slot += 1
        return slot

    def _spread(self, values: np.ndarray, out: np.ndarray) -> None:
        """``out[slot] = values`` for every action, by one slice per rank."""
        for (a, b), (c, d) in zip(self.rows, self.spans):
            out[a:b] = values[c:d]

    def _rows(self, values: np.ndarray) -> np.ndarray:
        """``values`` at every action's slot, by one slice per rank: no index array to read."""
        return np.concatenate([values[a:b] for a, b in self.rows]) if self.rows else values[:0].copy()


def _keys(stage: IntArray, microbatch: IntArray, t: int) -> IntArray:
    """``stage * t + microbatch`` as indices (intp: no int32 product to overflow, no copy when indexing)."""
    key = stage.astype(np.intp)
    key *= t
    key += microbatch
    return key


def _neighbours(placement: Placement) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Per stage, its previous and its next stage in its pipeline (-1: none), as arrays."""
    prev, nxt = placement.neighbours()
    return np.asarray(prev, dtype=np.int64), np.asarray(nxt, dtype=np.int64)


def _hops(latency: Latency, neighbour: NDArray[np.int64], stage_rank: IntArray) -> FloatArray:
    """Per stage, ``latency`` of the message from its ``neighbour`` stage (0 where there is none or it
    is on the same rank): one call per stage, as a stage has one neighbour each way."""
    out = np.zeros(len(neighbour))
    for dst, src in enumerate(neighbour.tolist()):
        if src >= 0 and stage_rank[src] != stage_rank[dst]:
            out[dst] = latency(src, dst)
    return out


def _run_updates(
    schedule: Schedule,
    arrays: ScheduleArrays,
    durations: FloatArray,
    gap: float,
    delay: Sequence[float] | None,
    start: FloatArray,
    end: FloatArray,
    walked: IntArray | None = None,
) -> bool:
    """Time the synchronous ``U`` at the rows' ends, as the reference does (False: leave it to it).

    ``U`` of a part waits for every weight gradient of the part; with
    ``delay``, for the part's reduction too, which starts when its last weight
    gradient ends, on the rank's communication stream after the reductions the
    rank launched before it. ``walked`` (per action, its place in the reference's walk) says which
    rank that is for a part held on two ranks.
    """
    part_of = np.asarray(schedule.placement.stage_part, dtype=np.int64)
    grads = (arrays.op == B) | (arrays.op == W)
    parts = part_of[arrays.stage[grads]]
    num_parts = schedule.num_parts
    ready = np.zeros(num_parts)
    np.maximum.at(ready, parts, end[grads])
    done = ready.tolist()
    if delay is not None and not _reduce(arrays, grads, parts, num_parts, delay, done, walked):
        return False
    have = np.bincount(parts, minlength=num_parts) > 0
    updates = np.flatnonzero(arrays.op == U)
    stages = arrays.stage[updates].tolist()
    if stages and not have[part_of[stages]].all():
        return False  # a part without weight gradients: the reference's U waits forever
    offsets, ranks = arrays.offsets.tolist(), arrays.rank[updates].tolist()
    for index, s, r in zip(updates.tolist(), stages, ranks):
        i = index - offsets[r]
        t = float(end[index - 1]) if i else 0.0
        t0 = t + gap if gap and i else t
        t_dep = done[int(part_of[s])]
        t0 = t_dep if t_dep > t0 else t0
        start[index] = t0
        end[index] = t0 + float(durations[s, U])
    return True


def _reduce(
    arrays: ScheduleArrays,
    grads: NDArray[np.bool_],
    parts: IntArray,
    num_parts: int,
    delay: Sequence[float],
    done: list[float],
    walked: IntArray | None,
) -> bool:
    """Add each part's reduction to ``done``: launched by the weight gradient that completes the part
    (the last one walked, ``walked``; else the last in row order, which must then be on one rank),
    on its rank's stream, after the reductions that rank launched earlier in its row."""
    flat = np.flatnonzero(grads)
    if walked is None:
        ranks = arrays.rank[grads]
        holder = np.full(num_parts, -1, dtype=np.int64)
        holder[parts] = ranks
        if (holder[parts] != ranks).any():
            return False
        key: IntArray = flat
    else:
        key = walked[grads]
    completing = np.full(num_parts, -1, dtype=np.int64)
    by_key = np.argsort(key, kind="stable")
    completing[parts[by_key]] = flat[by_key]  # the largest key of each part is written last
    stream: dict[int, float] = {}
    for part in sorted(range(num_parts), key=lambda p: int(completing[p])):  # row order on each rank
        if completing[part] < 0:
            continue
        r = int(arrays.rank[completing[part]])
        free = stream.get(r, 0.0)
        ready = done[part]
        done[part] = stream[r] = (ready if ready > free else free) + delay[part]
    return True
