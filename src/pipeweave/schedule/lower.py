"""Lowering: insert the point-to-point communication a schedule implies.

Naming follows torch.distributed.pipelining: ``SEND_F(s, j)`` is stage ``s``
sending its output for microbatch ``j``; ``RECV_F(s, j)`` is stage ``s``
receiving its input; ``SEND_B(s, j)`` sends stage ``s``'s input gradient back;
``RECV_B(s, j)`` receives the gradient of stage ``s``'s output. A send follows
its producer immediately and a receive precedes its consumer immediately;
neighbouring stages on the same rank exchange tensors locally, with no action.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeweave.schedule.ir import Action, Op, Schedule


@dataclass(frozen=True)
class LoweredSchedule:
    """A schedule with its communication actions.

    Attributes:
        schedule: the compute schedule it was lowered from.
        actions: per rank, compute and communication actions in order.
    """

    schedule: Schedule
    actions: tuple[tuple[Action, ...], ...]

    def peer(self, a: Action) -> int:
        """The rank on the other side of a communication action."""
        schedule = self.schedule
        if a.op in (Op.SEND_F, Op.RECV_B):
            other = schedule.next_of(a.stage, a.microbatch)
        elif a.op in (Op.RECV_F, Op.SEND_B):
            other = schedule.prev_of(a.stage, a.microbatch)
        else:
            raise ValueError(f"{a} is not a communication action")
        if other is None:
            raise ValueError(f"{a} has no peer stage")
        return schedule.placement.stage_rank[other]


def lower(schedule: Schedule) -> LoweredSchedule:
    """Insert SEND/RECV actions around the compute actions that need them.

    Example:
        >>> from pipeweave.schedule import generate
        >>> [str(a) for a in lower(generate("gpipe", num_stages=2, num_microbatches=1)).actions[0]]
        ['0F0', '0SEND_F0', '0RECV_B0', '0B0', '0U0']
    """
    placement = schedule.placement
    rank_of = placement.stage_rank

    def crosses(stage: int, other: int | None) -> bool:
        return other is not None and rank_of[other] != rank_of[stage]

    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        for a in row:
            s, op, j = a
            if op is Op.F:
                if crosses(s, schedule.prev_of(s, j)):
                    out.append(Action(s, Op.RECV_F, j))
                out.append(a)
                if crosses(s, schedule.next_of(s, j)):
                    out.append(Action(s, Op.SEND_F, j))
            elif op.computes_input_grad:
                if crosses(s, schedule.next_of(s, j)):
                    out.append(Action(s, Op.RECV_B, j))
                out.append(a)
                if crosses(s, schedule.prev_of(s, j)):
                    out.append(Action(s, Op.SEND_B, j))
            else:
                out.append(a)
        rows.append(tuple(out))
    return LoweredSchedule(schedule, tuple(rows))
