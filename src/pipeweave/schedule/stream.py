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

from collections.abc import Callable, Sequence

from pipeweave.schedule.ir import Action, Op, Placement, ScheduleError, check_positive

Boundary = Callable[[int, int], bool]  # (stage, microbatch) -> does a U follow its backward?

DEFAULT_NUM_STEPS = 4
"""Mini-batches an asynchronous stream covers by default: warm-up, two steady steps, drain."""


def check_stream(num_stages: int, num_microbatches: int, num_steps: int) -> None:
    """Raise ScheduleError unless D, T and the number of steps are >= 1."""
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    check_positive("num_steps", num_steps, "give num_steps >= 1 (mini-batches in the stream)")


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
    return [
        [Action(r, op, j) for op, j in stream_order(max(cap - r - 1, 0), total)]
        for r in range(num_stages)
    ]


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
            if a.op in (Op.B, Op.W) and boundary(a.stage, a.microbatch):
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

    Args:
        placement: stages and ranks.
        routes: per microbatch, the stages it visits in forward order.
        in_flight: per stage, how many microbatches may sit between F and B.
        admit: ``admit(stage, microbatch, backwards_done)``: may this forward
            start, given how many backwards the stage has finished (AvgPipe's
            replicas finish a mini-batch before starting the next).

    Raises:
        ScheduleError: the bounds leave no rank able to progress.
    """
    n = placement.num_ranks
    todo: list[list[tuple[Op, int, int]]] = [[] for _ in range(n)]  # (op, microbatch, stage)
    for j, route in enumerate(routes):
        for s in route:
            todo[placement.stage_rank[s]] += [(Op.F, j, s), (Op.B, j, s)]
    pos = {s: i for route in routes for i, s in enumerate(route)}
    done_at: dict[tuple[Op, int, int], int] = {}
    open_: dict[int, int] = {}  # stage -> microbatches between F and B
    backs: dict[int, int] = {}  # stage -> backwards done
    rows: list[list[Action]] = [[] for _ in range(n)]
    free, t, left = [0] * n, 0, sum(map(len, todo))

    def ready(op: Op, j: int, s: int) -> bool:
        route, i = routes[j], pos[s]  # a stage belongs to one pipeline: one position
        if op is Op.F:
            prev_ok = i == 0 or done_at.get((Op.F, j, route[i - 1]), t + 1) <= t
            gate = admit is None or admit(s, j, backs.get(s, 0))
            return prev_ok and gate and open_.get(s, 0) < in_flight(s)
        nxt_ok = i == len(route) - 1 or done_at.get((Op.B, j, route[i + 1]), t + 1) <= t
        return nxt_ok and done_at.get((Op.F, j, s), t + 1) <= t

    while left:
        progressed = False
        for r in range(n):
            if free[r] > t:
                continue
            choice = _pick(todo[r], ready, pos)
            if choice is None:
                continue
            op, j, s = choice
            todo[r].remove(choice)
            rows[r].append(Action(s, op, j))
            free[r] = t + (1 if op is Op.F else 2)
            done_at[(op, j, s)] = free[r]
            open_[s] = open_.get(s, 0) + (1 if op is Op.F else -1)
            backs[s] = backs.get(s, 0) + (op is Op.B)
            left -= 1
            progressed = True
        if not progressed and all(f <= t for f in free):
            raise ScheduleError("the in-flight bounds leave every rank idle; raise the bound")
        t += 1
    return rows


def _pick(
    todo: list[tuple[Op, int, int]],
    ready: Callable[[Op, int, int], bool],
    pos: dict[int, int],
) -> tuple[Op, int, int] | None:
    """The ready action of least (is forward, microbatch, -position): backward first, oldest first.

    ``todo`` is in (microbatch, route) order, so the scan for forwards can stop
    at the first microbatch that has a ready one; backwards are all considered.
    """
    best: tuple[Op, int, int] | None = None
    best_key: tuple[bool, int, int] | None = None
    stop_j: int | None = None  # once a ready forward is found, later microbatches cannot win
    for c in todo:
        op, j, s = c
        if op is Op.F and stop_j is not None and j > stop_j:
            continue
        if best_key is not None and best_key[0] is False and op is Op.F:
            continue
        if not ready(op, j, s):
            continue
        key = (op is Op.F, j, -pos[s])
        if best_key is None or key < best_key:
            best, best_key = c, key
        if op is Op.F:
            stop_j = j if stop_j is None else min(stop_j, j)
    return best

