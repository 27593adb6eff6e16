"""Data dependencies of the IR, and an in-order execution of a schedule over them.

Every rank runs its list in order; an action starts when its rank is free and
the data it needs exists (DESIGN.md, dependencies):

- ``F(s, j)`` needs ``F(prev(s), j)``;
- ``B(s, j)`` and ``I(s, j)`` need ``F(s, j)`` and the input gradient of
  ``next(s)`` for ``j`` (made by its ``B`` or ``I``);
- ``W(s, j)`` needs ``I(s, j)``;
- under the synchronous policy ``U(s, k)`` needs every weight gradient of every
  stage holding the same part (the replicas' gradients are combined first);
- under an asynchronous policy ``U(s, k)`` applies the weight gradients of
  stage s that its rank ran since ``U(s, k-1)`` (``consumed_gradients``): they
  precede it on its own rank, so the order alone satisfies the dependency.

An F&B pair (``Schedule.pairs``) runs as its F then its B or I; checked
strictly (``strict_pairs``), its F waits for the inputs of both halves, so a
pair whose B half needs what its F half makes -- on this rank or through
another -- is stuck. Sends are non-blocking (the runtime's ``isend`` is waited
lazily), so with sends and receives inserted the schedule deadlocks exactly
when this execution gets stuck. The same walk times a schedule when given durations: it is the core of
the simulator, kept here so that ``schedule`` needs nothing from ``sim``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pipeweave.schedule.ir import Action, Op, Schedule, pair_positions

# Keys of produced data: (kind, stage, microbatch). Kinds:
_FWD, _GRAD, _IGRAD, _PART = 0, 1, 2, 3  # activation, input grad, I done, part's grads all done

Duration = Callable[[Action], float]
Latency = Callable[[int, int], float]  # (from stage, to stage) -> time
_INPUT_GRAD = frozenset(op for op in Op if op.computes_input_grad)  # sets, not a property per action
_WEIGHT_GRAD = frozenset(op for op in Op if op.computes_weight_grad)


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


def _expected_weight_grads(schedule: Schedule) -> dict[int, int]:
    """Per part, how many weight gradients its stages produce in the schedule."""
    count: dict[int, int] = {}
    part_of = schedule.placement.stage_part
    for row in schedule.actions:
        for s, op, _ in row:
            if op in _WEIGHT_GRAD:
                part = part_of[s]
                count[part] = count.get(part, 0) + 1
    return count


def execute(
    schedule: Schedule,
    duration: Duration | None = None,
    latency: Latency | None = None,
    *,
    op_times: Sequence[Mapping[Op, float]] | None = None,
    gap: float = 0.0,
    update_delay: Sequence[float] | None = None,
    strict_pairs: bool = False,
    rendezvous: bool = False,
) -> Execution:
    """Run every rank's list in order over the data dependencies.

    Args:
        schedule: the schedule; its actions are assumed well formed (see
            ``validate.check_actions``), their order is what this checks.
        duration: time of an action (default 0: order only).
        latency: communication time between two stages on different ranks.
        op_times: per stage, the time of each op; a faster alternative to
            ``duration`` (the simulator's path). Ignored when ``duration`` is given.
        gap: time between the end of an action and the earliest start of the
            next one on the same rank (a runtime's dispatch time).
        update_delay: per part, the time its gradients take to be reduced
            across data-parallel replicas before its ``U`` may start (default
            none). The reduction starts when the part's last weight gradient
            of the step ends, runs beside the rank's later actions, and waits
            for the reductions the same rank started before it (one
            communication stream per rank, as NCCL's collectives on one
            process group run in order).
        strict_pairs: an F&B pair's F waits for both halves' inputs (the validator's rule: each half's
            communication may then move while the other computes, with nothing of one waiting on the other).
        rendezvous: a message between ranks moves only once its receive is posted: ``latency`` counts from
            the later of its producer's end and the post, at the end of the receiving rank's action before
            the one that takes it -- or before an F&B pair's F half, for its B half (``CostModel.comm_rendezvous``).

    Example:
        >>> from pipeweave.schedule import generate
        >>> execute(generate("gpipe", num_stages=2, num_microbatches=2)).complete
        True
    """
    if op_times is None or duration is not None:
        op_times = [{op: 0.0 for op in Op}] * schedule.num_stages
    pairs = (strict_pairs or rendezvous) and bool(schedule.pairs)
    halves = [pair_positions(row, schedule.pairs) for row in schedule.actions] if pairs else None
    start, end, done, blocked = _walk(
        schedule, duration, latency, op_times, gap, update_delay, halves if strict_pairs else None, rendezvous, halves
    )
    waiting = {r: _describe(_decode(code, schedule.num_stages)) for r, code in blocked.items()}
    rows = schedule.actions
    for r in range(len(rows)):
        if done[r] < len(rows[r]) and r not in waiting:  # pragma: no cover - defensive
            waiting[r] = rows[r][done[r]]
    return Execution(start, end, done, waiting)


def _decode(code: int, num_stages: int) -> tuple[int, int, int]:
    """``(kind, stage, microbatch)`` of a waiter code ``(microbatch * S + stage) * 4 + kind``."""
    key, kind = divmod(code, 4)
    j, stage = divmod(key, num_stages)
    return kind, stage, j


def _walk(  # noqa: C901 - one flat loop, for speed (see the docstring)
    schedule: Schedule,
    duration: Duration | None,
    latency: Latency | None,
    op_times: Sequence[Mapping[Op, float]],
    gap: float = 0.0,
    update_delay: Sequence[float] | None = None,
    strict: Sequence[Mapping[int, int]] | None = None,
    rendezvous: bool = False,
    halves: Sequence[Mapping[int, int]] | None = None,
) -> tuple[list[list[float]], list[list[float]], list[int], dict[int, int]]:
    """The in-order walk: ``(start, end, done, blocked)``, ``blocked[rank]`` a waiter code.

    Produced data lives in one dict per kind, keyed ``microbatch * S + stage``
    (a part's gradients: ``update * S + part``); a blocked rank is parked under
    the code ``key * 4 + kind``. The loop does integer arithmetic and dict
    lookups only, in one function, because in steady state 1F1B blocks after
    almost every action and any per-resume set-up is paid that often (tuple
    keys and a dependency list per action were 2-3x slower). ``strict``: per rank, F half -> B half of its
    F&B pairs, checked strictly; ``halves`` the same, for ``rendezvous``'s posts.
    """
    placement = schedule.placement
    S = placement.num_stages
    prev, nxt = placement.neighbours()
    rank_of, part_of = placement.stage_rank, placement.stage_part
    rows, n = schedule.actions, schedule.num_ranks
    starts_of: list[list[float]] = [[] for _ in range(n)]
    ends_of: list[list[float]] = [[] for _ in range(n)]
    ptr = [0] * n
    blocked: dict[int, int] = {}
    clock = [0.0] * n
    fwd: dict[int, float] = {}
    grad: dict[int, float] = {}
    igrad: dict[int, float] = {}
    part_done: dict[int, float] = {}
    sync = schedule.is_synchronous
    remaining = _expected_weight_grads(schedule) if sync else {}
    part_ready: dict[int, float] = {}
    delay = update_delay if update_delay is not None and any(update_delay) else None
    stream = [0.0] * n  # per rank, when its communication stream is free (update_delay's reductions)
    last_w: dict[int, float] = {}  # asynchronous, per stage: the end of its latest weight gradient
    waiters: dict[int, list[int]] = {}
    queue = deque(range(n))
    F, I, W, U = Op.F, Op.I, Op.W, Op.U
    input_grad, weight_grad = _INPUT_GRAD, _WEIGHT_GRAD
    seconds = [set(h.values()) for h in halves] if rendezvous and halves is not None else None
    post = 0.0  # rendezvous: when this action's receives are posted
    while queue:
        r = queue.popleft()
        row, starts, ends = rows[r], starts_of[r], ends_of[r]
        i, t, n_row = ptr[r], clock[r], len(row)
        while i < n_row:
            a = row[i]
            s, op, j = a
            base = j * S
            t0 = t + gap if gap and i else t
            if rendezvous:  # posted when the action before ends; a B half's with its F half, one earlier
                post = (ends[i - 2] if i >= 2 else 0.0) if seconds is not None and i in seconds[r] else t
            need = -1  # waiter code of missing data, -1 when all is there
            if op is F:
                p = prev[s]
                if p >= 0:
                    t_dep = fwd.get(base + p)
                    if t_dep is None:
                        need = (base + p) * 4 + _FWD
                    else:
                        if latency is not None and rank_of[p] != r:
                            t_dep = (post if rendezvous and post > t_dep else t_dep) + latency(p, s)
                        t0 = t_dep if t_dep > t0 else t0
                if need < 0 and strict is not None and i in strict[r]:
                    need = _half_needs(row[strict[r][i]], S, nxt, fwd, grad)
            elif op in input_grad:
                t_dep = fwd.get(base + s)
                q = nxt[s]
                if t_dep is None:
                    need = (base + s) * 4 + _FWD
                else:
                    t0 = t_dep if t_dep > t0 else t0
                    if q >= 0:
                        t_dep = grad.get(base + q)
                        if t_dep is None:
                            need = (base + q) * 4 + _GRAD
                        else:
                            if latency is not None and rank_of[q] != r:
                                t_dep = (post if rendezvous and post > t_dep else t_dep) + latency(q, s)
                            t0 = t_dep if t_dep > t0 else t0
            elif op is W:
                t_dep = igrad.get(base + s)
                if t_dep is None:
                    need = (base + s) * 4 + _IGRAD
                else:
                    t0 = t_dep if t_dep > t0 else t0
            elif op is U and sync:
                t_dep = part_done.get(base + part_of[s])
                if t_dep is None:
                    need = (base + part_of[s]) * 4 + _PART
                else:
                    t0 = t_dep if t_dep > t0 else t0
            elif op is U and delay is not None:  # asynchronous: its rank's gradients since the last U, reduced
                t_dep = last_w.pop(s, None)
                if t_dep is not None:
                    t_dep = stream[r] = (t_dep if t_dep > stream[r] else stream[r]) + delay[part_of[s]]
                    t0 = t_dep if t_dep > t0 else t0
            if need >= 0:
                waiters.setdefault(need, []).append(r)
                blocked[r] = need
                break
            t = t0 + (duration(a) if duration is not None else op_times[s][op])
            starts.append(t0)
            ends.append(t)
            i += 1
            made = -1  # the code of the datum this action produced
            if op is F:
                made = (base + s) * 4 + _FWD
                fwd[base + s] = t
            elif op in input_grad:
                made = (base + s) * 4 + _GRAD
                grad[base + s] = t
                if op is I:
                    igrad[base + s] = t
                    _wake(waiters, blocked, queue, (base + s) * 4 + _IGRAD)
            if remaining and op in weight_grad:
                part = part_of[s]
                remaining[part] -= 1
                if t > part_ready.get(part, 0.0):
                    part_ready[part] = t
                if remaining[part] == 0:  # U of update 0 may run: key 0 * S + part
                    ready = part_ready.get(part, 0.0)
                    if delay is not None:
                        ready = stream[r] = (ready if ready > stream[r] else stream[r]) + delay[part]
                    part_done[part] = ready
                    _wake(waiters, blocked, queue, part * 4 + _PART)
            elif delay is not None and op in weight_grad:
                last_w[s] = t
            if made >= 0 and waiters:
                woken = waiters.pop(made, None)  # _wake, inlined: this runs per action
                if woken is not None:
                    for w in woken:
                        del blocked[w]
                        queue.append(w)
        ptr[r], clock[r] = i, t
    return starts_of, ends_of, ptr, blocked


def _half_needs(b: Action, S: int, nxt: Sequence[int], fwd: Mapping[int, float], grad: Mapping[int, float]) -> int:
    """The waiter code of what an F&B pair's B (or I) half ``b`` still misses, -1 when all is there."""
    s, _, j = b
    base = j * S
    if base + s not in fwd:
        return (base + s) * 4 + _FWD
    q = nxt[s]
    return (base + q) * 4 + _GRAD if q >= 0 and base + q not in grad else -1


def _wake(waiters: dict[int, list[int]], blocked: dict[int, int], queue: deque[int], code: int) -> None:
    """Requeue the ranks parked on ``code``."""
    ranks = waiters.pop(code, None)
    if ranks is not None:
        for r in ranks:
            del blocked[r]
            queue.append(r)


def consumed_gradients(schedule: Schedule) -> dict[Action, tuple[Action, ...]]:
    """Per ``U``, the weight-gradient actions (``B`` or ``W``) whose gradients it applies.

    Synchronous: ``U(s, 0)`` applies every gradient of every stage holding
    stage s's part (replicas all-reduced). Asynchronous: ``U(s, k)`` applies
    stage s's gradients that its rank ran after ``U(s, k-1)`` and before it.

    Example:
        >>> from pipeweave.schedule import generate
        >>> g = consumed_gradients(generate("1f1b", num_stages=2, num_microbatches=2))
        >>> [str(a) for a in g[Action(1, Op.U, 0)]]
        ['1B0', '1B1']
    """
    out: dict[Action, tuple[Action, ...]] = {}
    if schedule.is_synchronous:
        part_of = schedule.placement.stage_part
        by_part: dict[int, list[Action]] = {}  # grouped first: one pass, not one per U
        for _, _, a in schedule.iter_actions():
            if a.op in _WEIGHT_GRAD:
                by_part.setdefault(part_of[a.stage], []).append(a)
        for _, _, a in schedule.iter_actions():
            if a.op is Op.U:
                out[a] = tuple(by_part.get(part_of[a.stage], ()))
        return out
    for row in schedule.actions:
        pending: dict[int, list[Action]] = {}
        for a in row:
            if a.op in _WEIGHT_GRAD:
                pending.setdefault(a.stage, []).append(a)
            elif a.op is Op.U:
                out[a] = tuple(pending.pop(a.stage, []))
    return out


def _describe(key: tuple[int, int, int]) -> Action:
    kind, stage, j = key
    if kind == _FWD:
        return Action(stage, Op.F, j)
    if kind == _GRAD:
        return Action(stage, Op.B, j)  # B or I of that stage
    if kind == _IGRAD:
        return Action(stage, Op.I, j)
    return Action(stage, Op.W, -1)  # all weight gradients of part `stage`
