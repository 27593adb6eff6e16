"""torch.distributed.pipelining's two CSV formats, written and read exactly.

torch's ``_PipelineScheduleRuntime._load_csv(path, format)`` reads one row per
rank, one action per cell:

- ``compute_only``: ``F``, ``B``, ``I``, ``W`` (``0F3``, ``1I2``). There is no
  update action: the optimizer steps after ``step()`` returns. torch inserts
  the communication, ``UNSHARD``/``RESHARD`` and ``REDUCE_GRAD`` itself;
- ``compute_comms``: the same with ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``
  (``0SEND_F3``, ``1RECV_F3``), ``REDUCE_GRAD`` after a stage's last backward
  (it scales the gradients by 1/T) and, under FSDP, ``UNSHARD``/``RESHARD``
  (``0UNSHARD``: no microbatch), run as written.

torch also writes ``(0F7;7B3)OVERLAP_F_B``: a forward and a backward of two
stages of one rank, overlapped (DualPipe-V). pipeweave reads it as the F then
the B, an F&B pair (``Schedule.pairs``), and writes its pairs so; ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` are dropped on reading
(pipeweave's runtime gathers and reduces where its own configuration says),
and a comms-format file's sends and receives, once checked to pair, are
dropped too: pipeweave lowers the compute order itself.

torch expresses one synchronous pipeline through stages 0..S-1, stage s holding
part s, without memory actions; anything else is refused naming its first
action that torch cannot carry (``torch_refusal``).
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter, deque
from collections.abc import Iterable

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, ScheduleError
from pipeweave.schedule.lower import lower

TORCH_FORMATS = ("compute_only", "compute_comms")
_STAGE_ONLY = re.compile(r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")  # no microbatch of their own
_OVERLAP = re.compile(r"^\((.*)\)([A-Z_]+)$")
_COMPUTE = re.compile(r"^(\d+)([FBIW])(\d+)$")


def is_torch_token(token: str) -> bool:
    """True for a torch action pipeweave's own text form has not: ``0UNSHARD``, ``(0F7;7B3)OVERLAP_F_B``."""
    return _STAGE_ONLY.match(token) is not None or token.startswith("(")


def torch_token_actions(token: str) -> list[Action]:
    """What pipeweave runs for a torch-only action: an ``OVERLAP_F_B``'s sub-actions in order, else nothing.

    Raises:
        ScheduleError: a container other than ``OVERLAP_F_B``, or one holding what is not F, B, I or W.

    Example:
        >>> [str(a) for a in torch_token_actions("(0F7;7B3)OVERLAP_F_B")], torch_token_actions("0UNSHARD")
        (['0F7', '7B3'], [])
    """
    if _STAGE_ONLY.match(token):
        return []
    match = _OVERLAP.match(token)
    if match is None or match.group(2) != "OVERLAP_F_B":
        raise ScheduleError(
            f"cannot read action {token!r}: torch's only grouped action is (<F>;<B>)OVERLAP_F_B, e.g. (0F7;7B3)OVERLAP_F_B"
        )
    out = []
    for sub in match.group(1).split(";"):
        compute = _COMPUTE.match(sub.strip())
        if compute is None:
            raise ScheduleError(
                f"cannot run {token!r}: its part {sub.strip()!r} is no F, B, I or W action; "
                "an OVERLAP_F_B groups compute actions, e.g. (0F7;7B3)OVERLAP_F_B"
            )
        stage, op, microbatch = compute.groups()
        out.append(Action(int(stage), Op(op), int(microbatch)))
    return out


def row_cells(row: Iterable[Action], pairs: Iterable[tuple[Action, Action]], *, updates: bool = True) -> list[str]:
    """One rank's cells: an action each, an F&B pair as torch writes it, ``(<F>;<B>)OVERLAP_F_B``.

    Example:
        >>> f, b = Action(3, Op.F, 5), Action(0, Op.B, 0)
        >>> row_cells([Action(0, Op.F, 2), f, b, Action(0, Op.U, 0)], [(f, b)], updates=False)
        ['0F2', '(3F5;0B0)OVERLAP_F_B']
    """
    second = {f: b for f, b in pairs}
    cells: list[str] = []
    skip: Action | None = None
    for a in row:
        if a == skip or (not updates and a.op is Op.U):
            continue
        b = second.get(a)
        cells.append(str(a) if b is None else f"({a};{b})OVERLAP_F_B")
        skip = b
    return cells


def _counterpart(placement: Placement, send: Action) -> Action | None:
    """The receive that pairs with ``send``: ``0SEND_F3`` -> ``1RECV_F3``, ``1SEND_B3`` -> ``0RECV_B3``."""
    if send.op is Op.SEND_F:
        other = placement.next_stage(send.stage) if send.stage < placement.num_stages else None
        return None if other is None else Action(other, Op.RECV_F, send.microbatch)
    other = placement.prev_stage(send.stage) if send.stage < placement.num_stages else None
    return None if other is None else Action(other, Op.RECV_B, send.microbatch)


def check_pairs(rows: list[list[Action]], placement: Placement) -> None:
    """A comms-format file's sends and receives pair up: each send on its stage's rank, its receive on the peer's.

    Raises:
        ScheduleError: the first send without its receive, or receive without its send.
    """
    sends: dict[tuple[int, Action], list[Action]] = {}  # (receiving rank, receive) -> its sends
    recvs: Counter[tuple[int, Action]] = Counter()
    for rank, row in enumerate(rows):
        for a in row:
            if a.op.is_comm and a.stage < placement.num_stages and placement.stage_rank[a.stage] != rank:
                raise ScheduleError(
                    f"rank {rank}'s {a} acts for stage {a.stage}, which lives on rank {placement.stage_rank[a.stage]}; "
                    "a SEND or RECV goes on its stage's rank"
                )
            if a.op.is_send:
                recv = _counterpart(placement, a)
                if recv is None:
                    raise ScheduleError(f"rank {rank}'s {a} sends to no stage (stage {a.stage} has no neighbour there)")
                sends.setdefault((placement.stage_rank[recv.stage], recv), []).append(a)
            elif a.op.is_recv:
                recvs[(rank, a)] += 1
    for (rank, recv), count in recvs.items():
        if len(sends.get((rank, recv), ())) < count:
            raise ScheduleError(
                f"rank {rank}'s {recv} receives what no send delivers; pair every RECV with its peer's SEND "
                "(or give the compute-only form)"
            )
    for (rank, recv), sent in sends.items():
        if recvs[(rank, recv)] < len(sent):
            raise ScheduleError(
                f"{sent[0]} sends to rank {rank}, which has no {recv}; pair every SEND with its peer's RECV "
                "(or give the compute-only form)"
            )


def torch_refusal(schedule: Schedule) -> str | None:
    """Why torch.distributed.pipelining cannot run ``schedule``, naming the first action it cannot carry; None if it can."""
    placement = schedule.placement
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if a.op.is_memory:
                return (
                    f"rank {rank}'s {a} moves saved activations; torch.distributed.pipelining has no memory actions "
                    "(drop --offload/--balance-activations/--compress-activations)"
                )
            if placement.stage_part[a.stage] != a.stage or len(placement.pipelines) != 1:
                return (
                    f"rank {rank}'s {a} runs stage {a.stage}, one of {len(placement.replicas(a.stage))} replicas of "
                    f"part {placement.stage_part[a.stage]}; torch.distributed.pipelining holds each part once, "
                    "one pipeline through stages 0..S-1"
                )
    if not schedule.is_synchronous:
        update = next(a for row in schedule.actions for a in row if a.op is Op.U)
        return (
            f"{update} updates mid-stream ({schedule.policy} weights, no flush); "
            "torch.distributed.pipelining updates once, after a synchronous step"
        )
    return None


def _comms_rows(schedule: Schedule) -> list[list[Action]]:
    """pipeweave's lowering, each rank's receives from a peer posted in the order the peer sends them
    (torch's runtime matches point-to-point messages between two ranks in order)."""
    lowered = lower(schedule)
    placement = schedule.placement
    sent: dict[tuple[int, int], deque[Action]] = {}  # (sender, receiver) -> receives in the sender's order
    for rank, row in enumerate(lowered.actions):
        for a in row:
            if a.op.is_send:
                recv = _counterpart(placement, a)
                assert recv is not None  # lowering sends only to a neighbour
                sent.setdefault((rank, placement.stage_rank[recv.stage]), deque()).append(recv)
    rows = []
    for rank, row in enumerate(lowered.actions):
        out: list[Action] = []
        posted: set[Action] = set()
        for a in row:
            if a.op.is_recv:
                queue = sent[(lowered.peer(a), rank)]
                while a not in posted:  # this receive, and the peer's earlier ones not yet posted
                    nxt = queue.popleft()
                    out.append(nxt)
                    posted.add(nxt)
            elif a.op is not Op.U:
                out.append(a)
        rows.append(out)
    return rows


def _stage_cells(row: list[Action], microbatches: int, shard: bool) -> list[str]:
    """Cells of one comms row: ``REDUCE_GRAD`` after each stage's last weight gradient, with ``shard``
    ``UNSHARD`` before a stage's first action and ``RESHARD`` after its last."""
    grads: Counter[int] = Counter()
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, a in enumerate(row):
        first.setdefault(a.stage, i)
        last[a.stage] = i
    cells = []
    for i, a in enumerate(row):
        if shard and first[a.stage] == i:
            cells.append(f"{a.stage}UNSHARD")
        cells.append(str(a))
        if a.op.computes_weight_grad:
            grads[a.stage] += 1
            if grads[a.stage] == microbatches:
                cells.append(f"{a.stage}REDUCE_GRAD")
        if shard and last[a.stage] == i:
            cells.append(f"{a.stage}RESHARD")
    return cells


def to_torch_csv(schedule: Schedule, *, format: str = "compute_only", shard: bool = False) -> str:
    """The schedule as the CSV torch's ``_PipelineScheduleRuntime._load_csv(path, format)`` reads.

    Args:
        schedule: a schedule torch can run (``torch_refusal`` is None).
        format: ``compute_only`` (F, B, I, W) or ``compute_comms`` (lowered: sends, receives,
            ``REDUCE_GRAD``).
        shard: with ``compute_comms``, ``UNSHARD``/``RESHARD`` around each stage's actions (FSDP).

    Raises:
        ScheduleError: a schedule torch cannot run (the action it cannot carry), or an unknown format.

    Example:
        >>> from pipeweave.schedule import generate
        >>> print(to_torch_csv(generate("1f1b", num_stages=2, num_microbatches=2)), end="")
        0F0,0F1,0B0,0B1
        1F0,1B0,1F1,1B1
    """
    if format not in TORCH_FORMATS:
        raise ScheduleError(f"CSV format {format!r} is unknown; give one of {', '.join(TORCH_FORMATS)}")
    reason = torch_refusal(schedule)
    if reason is not None:
        raise ScheduleError(f"{schedule.name} cannot be written for torch.distributed.pipelining: {reason}")
    if format == "compute_only":
        rows: Iterable[list[str]] = (row_cells(row, schedule.pairs, updates=False) for row in schedule.actions)
    else:
        rows = (_stage_cells(row, schedule.num_microbatches, shard) for row in _comms_rows(schedule))
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()
