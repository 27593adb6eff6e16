"""The order of a step's point-to-point messages, derived from the lowered schedule alone (no torch).

Every message is named by a key ``(sender stage, kind, microbatch)``: kind 0
carries an activation forward (``SEND_F`` -> ``RECV_F``), 1 an input gradient
backward (``SEND_B`` -> ``RECV_B``), 2 a tied embedding/head gradient
sent at a tied stage's ``U`` (its microbatch field counts the stage's ``U``:
0 in a synchronous step, k at the k-th update of a stream). A synchronous
step's is posted by ``runtime.stage.tied`` (the transport only keeps its
place in the order); a stream's travels through the transport like the
others (``runtime.stage.tied_stream``). Replicas' gradients are summed
by collectives on groups of their own (``runtime.replicas``), not here.

NCCL ignores tags and matches the messages of a pair of ranks in posting
order, so correctness must not rest on tags. ``rank_sends`` derives from the
lowered schedule alone the order in which a rank posts its sends, message kind
by message kind as the executor runs them; a receiver posts its receives from
a peer in exactly that peer's order (computed the same way on every rank),
waiting on them in its own order. Tags are still unique per message, which
gloo matches on, so both transports see the same pairing.

``message_pairs`` gives the ordered pairs of ranks that exchange any message
at all: the launcher makes shared-memory rings for those alone
(``transport.shm``).
"""

from __future__ import annotations

from pipeweave.schedule.ir import Action, Op, Placement
from pipeweave.schedule.lower import LoweredSchedule

META = -1  # microbatch field of a metadata message
FWD, BWD, TIED = 0, 1, 2
KINDS = 3

Key = tuple[int, int, int]  # (sender stage, kind, microbatch or META; the update's count for TIED)


def message_key(lowered: LoweredSchedule, a: Action) -> Key:
    """The key of the message a communication action sends or receives.

    Example:
        >>> from pipeweave.schedule import generate, lower
        >>> low = lower(generate("1f1b", num_stages=2, num_microbatches=2))
        >>> message_key(low, Action(1, Op.RECV_F, 1))
        (0, 0, 1)
    """
    schedule = lowered.schedule
    if a.op is Op.SEND_F:
        return (a.stage, FWD, a.microbatch)
    if a.op is Op.SEND_B:
        return (a.stage, BWD, a.microbatch)
    if a.op is Op.RECV_F:
        sender = schedule.prev_of(a.stage, a.microbatch)
        direction = FWD
    elif a.op is Op.RECV_B:
        sender = schedule.next_of(a.stage, a.microbatch)
        direction = BWD
    else:
        raise ValueError(f"{a} is not a communication action")
    if sender is None:
        raise ValueError(f"{a} has no sender stage")
    return (sender, direction, a.microbatch)


def rank_sends(
    lowered: LoweredSchedule,
    rank: int,
    *,
    with_meta: bool,
    tied: dict[int, int] | None = None,
    meta_every_message: bool = False,
) -> list[tuple[int, Key]]:
    """Every message ``rank`` sends in one step, as ``(destination rank, key)`` in posting order.

    The executor's order: along the row a SEND action's message (preceded in
    the first step by its stream's metadata with ``with_meta``; every message
    by its own with ``meta_every_message``, where shapes vary), and at the
    ``U`` of a stage tied to a stage on another rank (``tied``: stage -> the
    stage holding the other end), its tied gradient, numbered by the stage's updates so far.

    Example:
        >>> from pipeweave.schedule import generate, lower
        >>> rank_sends(lower(generate("1f1b", num_stages=2, num_microbatches=2)), 1, with_meta=False)
        [(0, (1, 1, 0)), (0, (1, 1, 1))]
    """
    out: list[tuple[int, Key]] = []
    announced: set[tuple[int, int, int]] = set()  # (peer, stage, kind): a shared stage announces to each peer
    rank_of = lowered.schedule.placement.stage_rank
    updates: dict[int, int] = {}
    for a in lowered.actions[rank]:
        if a.op is Op.U and tied and a.stage in tied and rank_of[tied[a.stage]] != rank:
            k = updates[a.stage] = updates.get(a.stage, -1) + 1
            out.append((rank_of[tied[a.stage]], (a.stage, TIED, k)))
        if a.op.is_send:
            key = message_key(lowered, a)
            peer = lowered.peer(a)
            if meta_every_message or (with_meta and (peer, *key[:2]) not in announced):
                announced.add((peer, key[0], key[1]))
                out.append((peer, (key[0], key[1], META)))
            out.append((peer, key))
    return out


def send_order(
    lowered: LoweredSchedule,
    rank: int,
    *,
    with_meta: bool,
    tied: dict[int, int] | None = None,
    meta_every_message: bool = False,
) -> dict[int, list[Key]]:
    """Per destination rank, the keys ``rank`` sends in one step, in posting order (``rank_sends``)."""
    order: dict[int, list[Key]] = {}
    for peer, key in rank_sends(lowered, rank, with_meta=with_meta, tied=tied, meta_every_message=meta_every_message):
        order.setdefault(peer, []).append(key)
    return order


def message_pairs(placement: Placement, *, ties: bool = False) -> set[tuple[int, int]]:
    """Every ordered pair ``(sender, receiver)`` of ranks that the lowered schedule sends messages between.

    ``schedule.lower`` inserts a send wherever a stage and its next stage in
    their pipeline lie on two ranks: activations go one way, input gradients
    the other. ``ties``: the ends of each pipeline on two ranks exchange
    tied gradients through this transport too (an asynchronous stream's,
    ``runtime.stage.tied_stream``; a synchronous step's go through the
    process group, ``runtime.stage.tied``). Replicas' gradient sums and
    tensor-parallel collectives go through process groups, never here.

    Example:
        >>> from pipeweave.schedule import generate
        >>> sorted(message_pairs(generate("1f1b", num_stages=3, num_microbatches=3).placement))
        [(0, 1), (1, 0), (1, 2), (2, 1)]
    """
    rank_of = placement.stage_rank
    pairs: set[tuple[int, int]] = set()
    for line in placement.pipelines:  # a shared stage (PipeDream's replicas) has a neighbour per pipeline
        for stage, following in zip(line, line[1:]):
            if rank_of[following] != rank_of[stage]:
                pairs |= {(rank_of[stage], rank_of[following]), (rank_of[following], rank_of[stage])}
    if ties:
        for line in placement.pipelines:
            first, last = rank_of[line[0]], rank_of[line[-1]]
            if first != last:
                pairs |= {(first, last), (last, first)}
    return pairs
