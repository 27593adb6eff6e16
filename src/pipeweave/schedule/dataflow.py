"""Data dependencies of the IR, and an in-order execution of a schedule over them.

Every rank runs its list in order; an action starts when its rank is free and
the data it needs exists (DESIGN.md, dependencies):

- ``F(s, j)`` needs ``F(prev(s), j)``;
- ``B(s, j)`` and ``I(s, j)`` need ``F(s, j)`` and the input gradient of
  ``next(s)`` for ``j`` (made by its ``B`` or ``I``);
- ``W(s, j)`` needs ``I(s, j)``;
- under the synchronous policy ``U(s, k)`` needs every weight gradient of every
  stage holding the same part (the replicas' gradients are combined first).

Sends are non-blocking (the runtime's ``isend`` is waited lazily), so with sends
and receives inserted the schedule deadlocks exactly when this execution gets
stuck. The same walk times a schedule when given durations: it is the core of
the simulator, kept here so that ``schedule`` needs nothing from ``sim``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pipeweave.schedule.ir import Action, Op, Schedule

# Keys of produced data: (kind, stage, microbatch). Kinds:
_FWD, _GRAD, _IGRAD, _PART = 0, 1, 2, 3  # activation, input grad, I done, part's grads all done

Duration = Callable[[Action], float]
Latency = Callable[[int, int], float]  # (from stage, to stage) -> time


@dataclass
class Execution:
    """The outcome of an in-order execution.

    Attributes:
        start, end: per rank, the start and end time of each executed action.
        done: per rank, how many of its actions ran; a rank with
            ``done[r] < len(actions[r])`` is stuck.
        waiting_for: per stuck rank, the action it waits on: ``(stage, op, mb)``
            of the missing producer, described as an Action (for ``U``, the
            op is ``W`` and mb -1: "all weight gradients of that part").
    """

    start: list[list[float]]
    end: list[list[float]]
    done: list[int]
    waiting_for: dict[int, Action]

    @property
    def complete(self) -> bool:
        return not self.waiting_for


def _dependencies(schedule: Schedule, a: Action) -> list[tuple[int, int, int]]:
    placement = schedule.placement
    s, op, j = a
    if op is Op.F:
        prev = placement.prev_stage(s)
        return [] if prev is None else [(_FWD, prev, j)]
    if op is Op.B or op is Op.I:
        nxt = placement.next_stage(s)
        deps = [(_FWD, s, j)]
        return deps if nxt is None else deps + [(_GRAD, nxt, j)]
    if op is Op.W:
        return [(_IGRAD, s, j)]
    if op is Op.U:
        return [(_PART, placement.stage_part[s], j)] if schedule.is_synchronous else []
    return []


def _expected_weight_grads(schedule: Schedule) -> dict[int, int]:
    """Per part, how many weight gradients its stages produce in the schedule."""
    count: dict[int, int] = {}
    for row in schedule.actions:
        for s, op, _ in row:
            if op is Op.B or op is Op.W:
                part = schedule.placement.stage_part[s]
                count[part] = count.get(part, 0) + 1
    return count


def execute(
    schedule: Schedule,
    duration: Duration | None = None,
    latency: Latency | None = None,
) -> Execution:
    """Run every rank's list in order over the data dependencies.

    Args:
        schedule: the schedule; its actions are assumed well formed (see
            ``validate.check_actions``), their order is what this checks.
        duration: time of an action (default 0: order only).
        latency: communication time between two stages on different ranks.

    Example:
        >>> from pipeweave.schedule import generate
        >>> execute(generate("gpipe", num_stages=2, num_microbatches=2)).complete
        True
    """
    rank_of = schedule.placement.stage_rank
    part_of = schedule.placement.stage_part
    rows = schedule.actions
    n = len(rows)
    start: list[list[float]] = [[] for _ in range(n)]
    end: list[list[float]] = [[] for _ in range(n)]
    ptr = [0] * n
    clock = [0.0] * n
    produced: dict[tuple[int, int, int], float] = {}
    remaining = _expected_weight_grads(schedule) if schedule.is_synchronous else {}
    part_ready: dict[int, float] = {}
    waiters: dict[tuple[int, int, int], list[int]] = {}
    blocked: dict[int, tuple[int, int, int]] = {}
    queue = deque(range(n))

    def produce(key: tuple[int, int, int], t: float) -> None:
        produced[key] = t
        for r in waiters.pop(key, ()):
            del blocked[r]
            queue.append(r)

    while queue:
        r = queue.popleft()
        row, i, t_rank = rows[r], ptr[r], clock[r]
        while i < len(row):
            a = row[i]
            t0 = t_rank
            missing = None
            for key in _dependencies(schedule, a):
                t_dep = produced.get(key)
                if t_dep is None:
                    missing = key
                    break
                if latency is not None and key[0] != _PART and rank_of[key[1]] != r:
                    t_dep += latency(key[1], a.stage)
                t0 = max(t0, t_dep)
            if missing is not None:
                waiters.setdefault(missing, []).append(r)
                blocked[r] = missing
                break
            t1 = t0 + (duration(a) if duration is not None else 0.0)
            start[r].append(t0)
            end[r].append(t1)
            t_rank = t1
            i += 1
            s, op, j = a
            if op is Op.F:
                produce((_FWD, s, j), t1)
            elif op is Op.B or op is Op.I:
                produce((_GRAD, s, j), t1)
                if op is Op.I:
                    produce((_IGRAD, s, j), t1)
            if (op is Op.B or op is Op.W) and remaining:
                part = part_of[s]
                remaining[part] -= 1
                part_ready[part] = max(part_ready.get(part, 0.0), t1)
                if remaining[part] == 0:
                    produce((_PART, part, 0), part_ready[part])
        ptr[r], clock[r] = i, t_rank
    # Parts without any weight gradient never release their U: report them too.
    waiting = {r: _describe(key) for r, key in blocked.items()}
    for r in range(n):
        if ptr[r] < len(rows[r]) and r not in waiting:  # pragma: no cover - defensive
            waiting[r] = rows[r][ptr[r]]
    return Execution(start, end, ptr, waiting)


def _describe(key: tuple[int, int, int]) -> Action:
    kind, stage, j = key
    if kind == _FWD:
        return Action(stage, Op.F, j)
    if kind == _GRAD:
        return Action(stage, Op.B, j)  # B or I of that stage
    if kind == _IGRAD:
        return Action(stage, Op.I, j)
    return Action(stage, Op.W, -1)  # all weight gradients of part `stage`
