"""The validator: every dependency rule of DESIGN.md, and a deadlock check.

``validate(schedule)`` raises ``InvalidSchedule`` naming the rank and step of
the first problem, with a text grid of the schedule and that step marked.
"""

from __future__ import annotations

from collections import Counter

from pipeweave.schedule.dataflow import execute
from pipeweave.schedule.grid import format_grid
from pipeweave.schedule.ir import Action, Op, Schedule, ScheduleError
from pipeweave.schedule.lower import lower


class InvalidSchedule(ScheduleError):
    """A schedule breaks a rule; ``rank`` and ``step`` locate it (-1 when global)."""

    def __init__(self, reason: str, schedule: Schedule, rank: int = -1, step: int = -1) -> None:
        self.reason, self.rank, self.step = reason, rank, step
        where = f"rank {rank} step {step}: " if rank >= 0 else ""
        mark = (rank, step) if rank >= 0 and step >= 0 else None
        grid = format_grid(schedule, mark=mark)
        super().__init__(f"invalid schedule {schedule.name!r}: {where}{reason}\n{grid}")


def validate(schedule: Schedule) -> None:
    """Check placement, exactly-once, order and deadlock freedom.

    Deadlock freedom of the lowered schedule (``lower``) follows from the
    in-order walk: sends are non-blocking and each receive sits right before
    its consumer, so the lowered schedule gets stuck exactly where the walk
    does. ``check_lowering`` checks the lowering itself (run by the tests on
    every registry family); it is not repeated here because it costs as much
    as the rest of validation together.

    Raises:
        InvalidSchedule: with the rank, the step and a marked grid.

    Example:
        >>> from pipeweave.schedule import generate
        >>> validate(generate("zb-h1", num_stages=4, num_microbatches=8))
    """
    check_actions(schedule)
    check_overlap(schedule)
    check_order(schedule)
    check_updates(schedule)
    check_stream_updates(schedule)


def is_valid(schedule: Schedule) -> bool:
    try:
        validate(schedule)
    except InvalidSchedule:
        return False
    return True


_OP_BIT = {Op.F: 1, Op.B: 2, Op.I: 4, Op.W: 8}
_COMPLETE = (1 | 2, 1 | 4 | 8)  # F + B, or F + I + W


def _actions_look_valid(schedule: Schedule) -> bool:
    """One fast pass over the rules of ``check_actions``; False sends it to the detailed pass."""
    placement = schedule.placement
    stage_rank, t, mbp = placement.stage_rank, schedule.num_microbatches, schedule.microbatch_pipeline
    num_stages = len(stage_rank)
    stage_pipe = [placement.pipeline_of(s) for s in range(num_stages)]
    if schedule.num_ranks != placement.num_ranks:
        return False
    masks: dict[int, int] = {}
    updates: set[tuple[int, int]] = set()
    for rank, row in enumerate(schedule.actions):
        for s, op, j in row:
            if not (0 <= s < num_stages and stage_rank[s] == rank):
                return False
            if op is Op.U:
                if (s, j) in updates:
                    return False
                updates.add((s, j))
                continue
            bit = _OP_BIT.get(op)
            if bit is None or not 0 <= j < t or (mbp[j] if mbp else 0) != stage_pipe[s]:
                return False
            key = s * t + j
            mask = masks.get(key, 0)
            if mask & bit:
                return False
            masks[key] = mask | bit
    expected = sum(len(schedule.route(j)) for j in range(t)) if mbp else t * len(placement.pipelines[0])
    return len(masks) == expected and all(m in _COMPLETE for m in masks.values())


def check_actions(schedule: Schedule) -> None:
    """Placement and exactly-once rules, without looking at the order."""
    if _actions_look_valid(schedule):
        return
    placement = schedule.placement
    if schedule.num_ranks != placement.num_ranks:
        raise InvalidSchedule(
            f"{schedule.num_ranks} action lists for a placement over {placement.num_ranks} ranks",
            schedule,
        )
    seen: dict[Action, tuple[int, int]] = {}
    for rank, step, a in schedule.iter_actions():
        if not a.op.is_compute:
            raise InvalidSchedule(f"{a} is a communication action; give compute actions only", schedule, rank, step)
        if not 0 <= a.stage < placement.num_stages:
            raise InvalidSchedule(
                f"{a} names stage {a.stage}, but there are {placement.num_stages}", schedule, rank, step
            )
        if placement.stage_rank[a.stage] != rank:
            raise InvalidSchedule(
                f"{a} runs on rank {rank}, but stage {a.stage} is placed on rank {placement.stage_rank[a.stage]}",
                schedule,
                rank,
                step,
            )
        if a.op is not Op.U:
            if not 0 <= a.microbatch < schedule.num_microbatches:
                raise InvalidSchedule(
                    f"{a} names microbatch {a.microbatch}, but there are {schedule.num_microbatches}",
                    schedule,
                    rank,
                    step,
                )
            if a.stage not in schedule.route(a.microbatch):
                raise InvalidSchedule(
                    f"{a}: microbatch {a.microbatch} does not pass through stage {a.stage}", schedule, rank, step
                )
        if a in seen:
            r0, k0 = seen[a]
            raise InvalidSchedule(f"{a} appears twice (first at rank {r0} step {k0})", schedule, rank, step)
        seen[a] = (rank, step)
    for j in range(schedule.num_microbatches):
        for s in schedule.route(j):
            _check_microbatch(schedule, seen, s, j)


def _check_microbatch(schedule: Schedule, seen: dict[Action, tuple[int, int]], s: int, j: int) -> None:
    def at(op: Op) -> tuple[int, int] | None:
        return seen.get(Action(s, op, j))

    rank = schedule.placement.stage_rank[s]
    if at(Op.F) is None:
        raise InvalidSchedule(f"{s}F{j} is missing: every stage runs F once per microbatch", schedule, rank)
    full, inp, wgt = at(Op.B), at(Op.I), at(Op.W)
    if full is not None and (inp is not None or wgt is not None):
        r, k = inp or wgt or full
        raise InvalidSchedule(f"stage {s} microbatch {j} has both B and I/W; use one or the other", schedule, r, k)
    if full is None and inp is None:
        raise InvalidSchedule(f"{s}B{j} (or {s}I{j} + {s}W{j}) is missing", schedule, rank)
    if inp is not None and wgt is None:
        raise InvalidSchedule(f"{s}W{j} is missing: {s}I{j} needs its weight-gradient half", schedule, *inp)
    if wgt is not None and inp is None:
        raise InvalidSchedule(f"{s}I{j} is missing: {s}W{j} has no input-gradient half", schedule, *wgt)


def check_overlap(schedule: Schedule) -> None:
    """F&B pairs (``Schedule.pairs``): each an F and the B or I right after it on its rank, of another stage or
    microbatch, no action in two pairs. That neither half needs the other, also through other ranks, is
    ``check_order``'s: it starts a pair only once both halves' inputs are there."""
    if not schedule.pairs:
        return
    position = {a: (r, k) for r, k, a in schedule.iter_actions()}
    paired: set[Action] = set()
    for f, b in schedule.pairs:
        name = f"F&B pair ({f};{b})"
        if f.op is not Op.F or not b.op.computes_input_grad:
            raise InvalidSchedule(f"{name} is not an F and a B or I; write (<F>;<B or I>)", schedule)
        if f not in position or b not in position:
            missing = f if f not in position else b
            raise InvalidSchedule(f"{name} names {missing}, which no rank runs; pair two actions of a rank", schedule)
        rank, step = position[f]
        if position[b] != (rank, step + 1):
            raise InvalidSchedule(
                f"{name}: {b} must come right after {f} on rank {rank}; put the halves side by side",
                schedule,
                rank,
                step,
            )
        if f[::2] == b[::2]:
            raise InvalidSchedule(
                f"{name}: {b} needs what {f} makes; pair another microbatch's B", schedule, rank, step
            )
        if f in paired or b in paired:
            raise InvalidSchedule(
                f"{name}: {f if f in paired else b} is in two pairs; give it one", schedule, rank, step
            )
        paired.update((f, b))


def check_order(schedule: Schedule) -> None:
    """Run the schedule in order, each F&B pair once both halves' inputs are there; explain the first stuck rank
    (order or deadlock)."""
    run = execute(schedule, strict_pairs=True)
    if run.complete:
        return
    position = {a: (r, k) for r, k, a in schedule.iter_actions()}
    for rank in sorted(run.waiting_for):  # a rank waiting on its own later step is the root cause
        step, need = run.done[rank], run.waiting_for[rank]
        action = schedule.actions[rank][step]
        if need.op is Op.W and need.microbatch == -1:
            raise InvalidSchedule(
                f"{action} waits for every weight gradient of part {need.stage}, which never all arrive",
                schedule,
                rank,
                step,
            )
        producer = _producer(need, position)
        if producer is not None and producer[0] == rank:
            raise InvalidSchedule(
                f"{_as_pair(action, schedule)} needs {_name(need, position)}, which rank {rank} only runs "
                f"later, at step {producer[1]}",
                schedule,
                rank,
                step,
            )
    rank = min(run.waiting_for)
    chain = [
        f"rank {r} step {run.done[r]} ({_as_pair(schedule.actions[r][run.done[r]], schedule)}) waits for "
        f"{_name(run.waiting_for[r], position)}"
        for r in sorted(run.waiting_for)
    ]
    raise InvalidSchedule("deadlock: " + "; ".join(chain), schedule, rank, run.done[rank])


def _as_pair(action: Action, schedule: Schedule) -> str:
    """``action``, or the F&B pair it starts (which waits for both halves' inputs)."""
    b = next((b for f, b in schedule.pairs if f == action), None)
    return str(action) if b is None else f"F&B pair ({action};{b})"


def _producer(need: Action, position: dict[Action, tuple[int, int]]) -> tuple[int, int] | None:
    if need.op is Op.B:  # the input gradient comes from B or I
        return position.get(need) or position.get(Action(need.stage, Op.I, need.microbatch))
    return position.get(need)


def _name(need: Action, position: dict[Action, tuple[int, int]]) -> str:
    if need.op is Op.B and need not in position:
        return str(Action(need.stage, Op.I, need.microbatch))
    return str(need)


def check_updates(schedule: Schedule) -> None:
    """Synchronous schedules: one U per stage, after all of that stage's work."""
    if not schedule.is_synchronous:
        return
    for rank, row in enumerate(schedule.actions):
        counts = Counter(a.stage for a in row if a.op is Op.U)
        for s in schedule.placement.stages_on(rank):
            if counts[s] != 1:
                raise InvalidSchedule(
                    f"stage {s} has {counts[s]} U actions; a synchronous schedule updates each stage once",
                    schedule,
                    rank,
                )
        updated: set[int] = set()
        for step, a in enumerate(row):
            if a.op is Op.U:
                updated.add(a.stage)
            elif a.stage in updated:
                raise InvalidSchedule(
                    f"{a} comes after {a.stage}U0: a synchronous step updates a stage after all its work",
                    schedule,
                    rank,
                    step,
                )


def check_stream_updates(schedule: Schedule) -> None:
    """Asynchronous streams: each stage's U counted 0, 1, ... in order, none empty, none missing.

    ``U(s, k)`` applies stage s's gradients since ``U(s, k-1)`` on its rank
    (``dataflow.consumed_gradients``), so it comes after them by construction;
    what can go wrong is an update with nothing to apply, or gradients left
    unapplied at the end of the stream.
    """
    if schedule.is_synchronous:
        return
    for rank, row in enumerate(schedule.actions):
        updates: dict[int, int] = {}
        pending: dict[int, int] = {}
        for step, a in enumerate(row):
            if a.op.computes_weight_grad:
                pending[a.stage] = pending.get(a.stage, 0) + 1
            elif a.op is Op.U:
                k = updates.get(a.stage, 0)
                if a.microbatch != k:
                    raise InvalidSchedule(
                        f"{a} should be {a.stage}U{k}: number a stage's updates 0, 1, ...", schedule, rank, step
                    )
                if not pending.get(a.stage):
                    raise InvalidSchedule(
                        f"{a} applies no gradient: give it a B or W of stage {a.stage} first", schedule, rank, step
                    )
                updates[a.stage], pending[a.stage] = k + 1, 0
        for s, n in pending.items():
            if n:
                raise InvalidSchedule(
                    f"stage {s} ends with {n} gradient(s) no U applies; end its list with a U", schedule, rank
                )


def check_lowering(schedule: Schedule) -> None:
    """Every send of the lowered schedule has its receive, in the same order per pair."""
    lowered = lower(schedule)
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    for rank, row in enumerate(lowered.actions):
        for a in row:
            if a.op.is_send:
                sends.setdefault((rank, lowered.peer(a)), []).append(a)
            elif a.op.is_recv:
                recvs.setdefault((lowered.peer(a), rank), []).append(a)
    for pair in set(sends) | set(recvs):
        s_keys = [(a.op is Op.SEND_F, a.microbatch) for a in sends.get(pair, [])]
        r_keys = [(a.op is Op.RECV_F, a.microbatch) for a in recvs.get(pair, [])]
        if sorted(s_keys) != sorted(r_keys):  # pragma: no cover - lowering bug
            raise InvalidSchedule(f"sends and receives from rank {pair[0]} to {pair[1]} do not match", schedule)
