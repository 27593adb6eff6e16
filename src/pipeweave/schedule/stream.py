"""Asynchronous streams: many steps with no flush, and where their updates go.

An asynchronous schedule covers ``num_steps`` mini-batches of T microbatches,
numbered globally (microbatch j belongs to mini-batch j // T). There is no
flush: the next mini-batch's forwards start while the last one drains, and a
stage updates (``U``) as soon as it holds the gradients the policy asks for.

Which gradients an update consumes is one rule for every asynchronous family
(``schedule.dataflow.consumed_gradients``): ``U(s, k)`` applies the weight
gradients (``B`` or ``W``) of stage s that its rank ran since ``U(s, k-1)``.
Generators therefore place each ``U`` right after the backward that completes
its group: ``every(n)`` closes a group after every n microbatches of a stage.

A run that stops to evaluate or to save (``pipeweave train --eval-every K``)
drains its stream there and starts another: ``concatenate`` is such a run of
several streams as one schedule, for the simulator, the version tables and
the timeline.

Two stream builders:

- ``stream_order``: 1F1B without a flush (PipeDream's order), rank r warms up
  with w_r forwards then alternates one forward and one backward;
- ``greedy_stream``: a list scheduler for placements with several stages per
  rank (WPipe's two groups, AvgPipe's P pipelines): at unit costs (f = 1,
  B = 2, the simulator's default) each free rank runs its oldest ready backward,
  else its oldest admissible forward. The order it records was executed, so it
  cannot deadlock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, ScheduleError, check_positive

Boundary = Callable[[int, int], bool]  # (stage, microbatch) -> does a U follow its backward?

DEFAULT_NUM_STEPS = 4
"""Mini-batches an asynchronous stream covers by default: warm-up, two steady steps, drain."""


def check_stream(num_stages: int, num_microbatches: int, num_steps: int) -> None:
    """Raise ScheduleError unless D, T and the number of steps are >= 1."""
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    check_positive("num_steps", num_steps, "give num_steps >= 1 (mini-batches in the stream)")


def concatenate(segments: Sequence[Schedule]) -> Schedule:
    """Streams run one after the other, each drained before the next starts, as one schedule.

    Every rank's list is the segments' lists in order; segment i's microbatches
    are numbered after segment i - 1's, and so is each stage's ``U`` (update k
    of a segment is update ``k + updates before it`` of the run), so the
    versions every action reads (``sim.versions``) are the run's. Between two
    segments nothing is in flight: the drain is a flush.

    Raises:
        ScheduleError: no segment, a synchronous one, or segments of different placements or policies.

    Example:
        >>> from pipeweave.schedule import generate
        >>> one = generate("pipedream", num_stages=2, num_microbatches=1, num_steps=1)
        >>> [str(a) for a in concatenate([one, one]).actions[1]]
        ['1F0', '1B0', '1U0', '1F1', '1B1', '1U1']
    """
    if not segments:
        raise ScheduleError("concatenate needs at least one stream; give one or more segments")
    first = segments[0]
    for seg in segments:
        if seg.is_synchronous:
            raise ScheduleError(f"{seg.name} is synchronous: its steps already end in a flush; concatenate streams")
        if (seg.placement, seg.policy) != (first.placement, first.policy):
            raise ScheduleError(
                f"segments of one run share a placement and a policy; {seg.name} differs from "
                f"{first.name}: generate every segment with the same D, T and options"
            )
    if len(segments) == 1:
        return first
    rows: list[list[Action]] = [[] for _ in first.actions]
    pipelines: list[int] = []
    microbatches = 0
    updates: dict[int, int] = {}  # per stage, updates of the segments before
    for seg in segments:
        made: dict[int, int] = {}
        for rank, row in enumerate(seg.actions):
            for a in row:
                if a.op is Op.U:
                    rows[rank].append(Action(a.stage, Op.U, a.microbatch + updates.get(a.stage, 0)))
                    made[a.stage] = made.get(a.stage, 0) + 1
                else:
                    rows[rank].append(Action(a.stage, a.op, a.microbatch + microbatches))
        for stage, n in made.items():
            updates[stage] = updates.get(stage, 0) + n
        pipelines += seg.microbatch_pipeline or [0] * seg.num_microbatches
        microbatches += seg.num_microbatches
    return Schedule(
        first.name,
        first.placement,
        microbatches,
        tuple(map(tuple, rows)),
        microbatch_pipeline=tuple(pipelines) if any(pipelines) else (),
        policy=first.policy,
        num_steps=sum(seg.num_steps for seg in segments),
    )


def stream_order(warmup: int, total: int) -> list[tuple[Op, int]]:
    """One rank's 1F1B order without a flush: ``warmup`` forwards, then F/B pairs, then drain.

    Example:
        >>> [f"{op}{j}" for op, j in stream_order(1, 3)]
        ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    warmup = min(warmup, total)
    order = [(Op.F, j) for j in range(warmup)]
    for j in range(total - warmup):
        order += [(Op.F, warmup + j), (Op.B, j)]
    return order + [(Op.B, j) for j in range(total - warmup, total)]


def straight_rows(num_stages: int, total: int, in_flight: int | None = None) -> list[list[Action]]:
    """1F1B without a flush on D straight stages, at most ``in_flight`` microbatches at stage 0.

    The default (``in_flight = D``) is PipeDream's steady state: rank r keeps
    D - r microbatches in flight; a smaller bound leaves ranks idle.
    """
    cap = num_stages if in_flight is None else min(in_flight, num_stages)
    return [[Action(r, op, j) for op, j in stream_order(max(cap - r - 1, 0), total)] for r in range(num_stages)]


def peak_in_flight(order: Iterable[Sequence[Any]], stage: int) -> int:
    """The most microbatches of ``stage`` between their F and their backward (B or I) along ``order``, whose
    entries begin ``(stage, op, microbatch)``, op an ``Op`` or its letter: PipeDream's NOAM at stage 0.

    Example:
        >>> peak_in_flight(straight_rows(3, 6)[0], 0), peak_in_flight([(0, "F", 0), (0, "B", 0)], 0)
        (3, 1)
    """
    held = peak = 0
    for s, op, *_ in order:
        if s != stage:
            continue
        if str(op) == "F":
            held += 1
            peak = max(peak, held)
        elif str(op) in ("B", "I"):
            held -= 1
    return peak


def every(n: int, total: int) -> Boundary:
    """Close a group after every ``n`` microbatches of a stage (and after the last one)."""
    return lambda stage, j: (j + 1) % n == 0 or j == total - 1


def add_updates(rows: Sequence[Sequence[Action]], boundary: Boundary) -> list[list[Action]]:
    """Insert ``U(s, k)`` right after each backward (``B`` or ``W``) that closes a group.

    Example:
        >>> rows = add_updates([[Action(0, Op.F, 0), Action(0, Op.B, 0)]], every(1, 1))
        >>> [str(a) for a in rows[0]]
        ['0F0', '0B0', '0U0']
    """
    out = []
    for row in rows:
        count: dict[int, int] = {}
        new: list[Action] = []
        for a in row:
            new.append(a)
            if a.op.computes_weight_grad and boundary(a.stage, a.microbatch):
                k = count.get(a.stage, 0)
                new.append(Action(a.stage, Op.U, k))
                count[a.stage] = k + 1
        out.append(new)
    return out


def greedy_stream(
    placement: Placement,
    routes: Sequence[tuple[int, ...]],
    in_flight: Callable[[int], int],
    admit: Callable[[int, int, int], bool] | None = None,
) -> list[list[Action]]:
    """List-schedule F and B of every microbatch at f = 1, B = 2; returns per-rank orders.

    At every time unit each free rank runs, of its ready actions, the one of
    least (is forward, microbatch, -position in the route): its oldest ready
    backward, deepest first, else its oldest admissible forward. Event-driven:
    an action becomes ready when the one it waits for is scheduled (its end is
    known then), so a rank never rescans its whole list; forwards wait per
    stage in microbatch order, because a stage's gates (``in_flight`` and
    ``admit``) do not pass a later microbatch where they stop an earlier one.

    Args:
        placement: stages and ranks.
        routes: per microbatch, the stages it visits in forward order.
        in_flight: per stage, how many microbatches may sit between F and B.
        admit: ``admit(stage, microbatch, backwards_done)``: may this forward
            start, given how many backwards the stage has finished (AvgPipe's
            replicas finish a mini-batch before starting the next); it must
            not admit a microbatch after refusing an earlier one.

    Raises:
        ScheduleError: the bounds leave no rank able to progress.
    """
    stream = _GreedyStream(placement, routes, in_flight, admit)
    arrivals, starts = stream.arrivals(), stream.starts()
    t, left = 0, 2 * sum(map(len, routes))
    while left:  # each step advances one time unit, t
        next(arrivals)
        started = next(starts)
        if not started and all(f <= t for f in stream.free):
            raise ScheduleError("the in-flight bounds leave every rank idle; raise the bound")
        left -= started
        t += 1
    return stream.rows


class _GreedyStream:
    """``greedy_stream``'s state, and its two steps per time unit (``arrivals``, then ``starts``).

    An action is *coming* once the action it waits for is scheduled (its end
    is known then), and *ready* from that end on. The steps are generators,
    advanced once per time unit by ``greedy_stream``: their locals outlive a
    unit, so a unit costs no call set-up (the hot path of long streams).
    """

    __slots__ = (
        "routes",
        "in_flight",
        "admit",
        "rank_of",
        "pos",
        "stages_of",
        "coming",
        "backward",
        "forward",
        "open_",
        "backs",
        "rows",
        "free",
    )

    def __init__(
        self,
        placement: Placement,
        routes: Sequence[tuple[int, ...]],
        in_flight: Callable[[int], int],
        admit: Callable[[int, int, int], bool] | None,
    ) -> None:
        n = placement.num_ranks
        self.routes, self.in_flight, self.admit = routes, in_flight, admit
        self.rank_of = rank_of = placement.stage_rank
        self.pos = pos = {s: i for route in routes for i, s in enumerate(route)}  # a stage belongs to one pipeline
        self.stages_of: list[list[int]] = [[] for _ in range(n)]
        for s in sorted(pos):
            self.stages_of[rank_of[s]].append(s)
        # Per time, the actions coming then: (rank, is forward, j, -pos, stage); every first forward at 0.
        self.coming: defaultdict[int, list[tuple[int, bool, int, int, int]]] = defaultdict(list)
        self.coming[0] = [(rank_of[route[0]], True, j, -pos[route[0]], route[0]) for j, route in enumerate(routes)]
        self.backward: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # per rank, ready: (j, -pos, stage)
        self.forward: dict[int, list[int]] = {}  # per stage, its ready forwards' microbatches
        self.open_: dict[int, int] = {}  # stage -> microbatches between F and B
        self.backs: dict[int, int] = {}  # stage -> backwards done
        self.rows: list[list[Action]] = [[] for _ in range(n)]
        self.free = [0] * n  # per rank, when its running action ends

    def arrivals(self) -> Iterator[None]:
        """At t = 0, 1, ...: the actions coming at t are ready, a backward to its rank, a forward to its stage."""
        coming, forward, backward = self.coming, self.forward, self.backward
        for t in itertools.count():
            for r, is_f, j, neg_pos, s in coming.pop(t, ()):
                if is_f:
                    heapq.heappush(forward.setdefault(s, []), j)
                else:
                    heapq.heappush(backward[r], (j, neg_pos, s))
            yield

    def starts(self) -> Iterator[int]:
        """At t = 0, 1, ...: each free rank starts its oldest ready backward, else its oldest admissible
        forward, and what that action unblocks is coming at its end: after a forward the next stage's
        forward (at the last stage its own backward), after a backward the stage before's backward.
        Yields how many started at t.
        """
        free, backward, forward, rows, coming = self.free, self.backward, self.forward, self.rows, self.coming
        open_, backs, pos, rank_of, routes = self.open_, self.backs, self.pos, self.rank_of, self.routes
        in_flight, admit, stages_of = self.in_flight, self.admit, self.stages_of
        for t in itertools.count():
            started = 0
            for r in range(len(free)):
                if free[r] > t:
                    continue
                if backward[r]:
                    j, _, s = heapq.heappop(backward[r])
                    op = Op.B
                else:
                    best: tuple[int, int, int] | None = None
                    for s in stages_of[r]:
                        waiting = forward.get(s)
                        if not waiting or open_.get(s, 0) >= in_flight(s):
                            continue
                        j = waiting[0]
                        if admit is not None and not admit(s, j, backs.get(s, 0)):
                            continue
                        if best is None or (j, -pos[s]) < best[:2]:
                            best = (j, -pos[s], s)
                    if best is None:
                        continue
                    j, _, s = best
                    heapq.heappop(forward[s])
                    op = Op.F
                rows[r].append(Action(s, op, j))
                free[r] = done = t + (1 if op is Op.F else 2)
                route, i = routes[j], pos[s]
                if op is Op.F:
                    open_[s] = open_.get(s, 0) + 1
                    nxt = route[i + 1] if i + 1 < len(route) else None
                    if nxt is None:  # the last stage's backward waits for its own forward only
                        coming[done].append((r, False, j, -i, s))
                    else:
                        coming[done].append((rank_of[nxt], True, j, -(i + 1), nxt))
                else:
                    open_[s] -= 1
                    backs[s] = backs.get(s, 0) + 1
                    if i > 0:
                        prev = route[i - 1]
                        coming[done].append((rank_of[prev], False, j, -(i - 1), prev))
                started += 1
            yield started
