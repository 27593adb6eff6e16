"""Chimera (Li & Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with Bidirectional Pipelines", SC'21).

Two pipelines run in opposite directions over the same D ranks
(``Placement.bidirectional``): rank r holds part r of the "down" pipeline and
part D-1-r of the "up" pipeline, so every part has two replicas whose weight
gradients are all-reduced before the update (2 M_theta per rank).

A **basic unit** is D microbatches: the first D/2 take the down pipeline, the
other D/2 the up pipeline. Its per-rank order is the paper's merge of the two
pipelines, obtained here by list scheduling in unit time slots (forward = full
backward = one slot, the timing of the paper's figures) with Chimera's
priorities: a backward before a forward, then the stage deeper in its pipeline
(the microbatch nearer its loss), then the lower microbatch. For D = 4::

    rank 0 | 0F0 0F1 7F2 7B2 7F3 7B3 0B0 0B1
    rank 1 | 1F0 6F2 1F1 6F3 6B2 1B0 6B3 1B1
    rank 2 | 5F2 2F0 5F3 2F1 2B0 5B2 2B1 5B3
    rank 3 | 4F2 4F3 3F0 3B0 3F1 3B1 4B2 4B3

For T = kD (the paper's section on more microbatches than stages) the k basic
units are concatenated *with overlap*: unit u holds microbatches uD..uD+D-1,
and the same list scheduling runs over all of them with the unit first in the
priority, so a later unit never delays an earlier one but its forwards fill
the earlier unit's idle slots (the paper's "direct concatenation" figure).
For D = 4, T = 8 the first idle
slot of rank 0 already runs 0F4 of the second unit::

    rank 0 | 0F0 0F1 0F4 7F2 7B2 7F3 7B3 0B0 0F5 0B1 7F6 7B6 7F7 7B7 0B4 0B5

Closed forms, and the conditions under which the simulator reproduces them
exactly (checked by the tests on D = 2..8 even, T = D..4D; also seen to hold
up to D = 16, T = 6D):

- bubble ratio (D-2)/(2T+D-2) for every T = kD, a forward as long as a full
  backward (f = b + w), no communication time: every rank is busy 2T slots in
  a span of 2T + D - 2, the single unit's D - 2 idle slots and no more (the
  survey's Table 3 form, which the paper states for this concatenation).
- At the survey's other common assumption, backward = 2 x forward (b + w = 2f),
  a forward no longer fits a backward's slot, so gaps reopen between units
  (the paper's "intermediate bubbles"): idle time per rank 2(D-2) f at T = D
  and ((D-2)k + D - 3) f at T = kD, k >= 2, D >= 4 (measured; 0 for D = 2).
  The ratio still falls with T, towards (D-2)/(4D-2). The paper removes these
  gaps with *forward doubling* (two microbatches per forward, twice the
  activations) or *backward halving*; this generator does neither.
- weights 2 M_theta per rank (two replicas of a part on every rank);
- activations: at T = D between (D/2+1) M_a (first and last rank) and D M_a
  (middle ranks), the survey's range; for T >= 2D, D M_a on every rank — the
  fill raises the end ranks to the paper's upper bound D, never beyond.

Requires D even (two pipelines of D/2 microbatches each per unit) and T a
multiple of D (whole basic units).
"""

from __future__ import annotations

import heapq

from pipeweave.schedule.ir import (
    Action,
    Op,
    Placement,
    Schedule,
    ScheduleError,
    append_updates,
    check_positive,
)


def check_chimera(num_stages: int, num_microbatches: int) -> None:
    """Reject what Chimera cannot serve: odd D, T not a multiple of D.

    Raises:
        ScheduleError: one line naming the value and the fix.
    """
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    if num_stages % 2:
        raise ScheduleError(
            f"chimera needs an even number of stages, got num_stages={num_stages}; "
            f"use {num_stages + 1} or {max(2, num_stages - 1)}"
        )
    if num_microbatches % num_stages:
        up = -(-num_microbatches // num_stages) * num_stages
        raise ScheduleError(
            f"chimera needs num_microbatches a multiple of num_stages={num_stages} (whole basic units), "
            f"got {num_microbatches}; use {up}"
        )


def _priority(placement: Placement, a: Action) -> tuple[int, int, int, int]:
    # An earlier basic unit first (the next one only fills its idle slots), then
    # a backward (frees activations), then the stage nearest its loss.
    unit = a.microbatch // placement.num_ranks
    return (unit, a.op is Op.F, -placement.stage_part[a.stage], a.microbatch)


def _list_schedule(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """Per rank, F and B of ``num_microbatches // num_ranks`` overlapped basic units."""
    placement = Placement.bidirectional(num_ranks)
    half = num_ranks // 2
    heaps: list[list[tuple[tuple[int, int, int, int], Action]]] = [[] for _ in range(num_ranks)]

    def push(a: Action) -> None:
        heapq.heappush(heaps[placement.stage_rank[a.stage]], (_priority(placement, a), a))

    for j in range(num_microbatches):
        push(Action(placement.pipelines[j % num_ranks // half][0], Op.F, j))
    rows: list[list[Action]] = [[] for _ in range(num_ranks)]
    while any(heaps):
        # One unit slot: every rank runs its best ready action; what they
        # make ready only becomes available in the next slot.
        ran = [heapq.heappop(h)[1] for h in heaps if h]
        for a in ran:
            rows[placement.stage_rank[a.stage]].append(a)
        for s, op, j in ran:
            if op is Op.F:
                nxt = placement.next_stage(s)
                push(Action(nxt, Op.F, j) if nxt is not None else Action(s, Op.B, j))
            else:
                prev = placement.prev_stage(s)
                if prev is not None:
                    push(Action(prev, Op.B, j))
    return rows


def basic_unit(num_ranks: int) -> list[list[Action]]:
    """Per rank, the order of one basic unit of D microbatches (without U).

    Example:
        >>> [str(a) for a in basic_unit(2)[0]]
        ['0F0', '3F1', '3B1', '0B0']
    """
    return _list_schedule(num_ranks, num_ranks)


def chimera(num_stages: int, num_microbatches: int) -> Schedule:
    """Chimera: two opposite pipelines, T/D basic units concatenated with overlap.

    Args:
        num_stages: D, the number of ranks (even).
        num_microbatches: T, a multiple of D.

    Raises:
        ScheduleError: odd D or T not a multiple of D.

    Example:
        >>> s = chimera(2, 2)
        >>> [str(a) for a in s.actions[1]]
        ['2F1', '1F0', '1B0', '2B1', '1U0', '2U0']
    """
    check_chimera(num_stages, num_microbatches)
    d = num_stages
    placement = Placement.bidirectional(d)
    rows = _list_schedule(d, num_microbatches)
    append_updates(rows, placement)
    # Within each unit the first D/2 microbatches go down, the others up.
    pipelines = tuple(int(j % d >= d // 2) for j in range(num_microbatches))
    return Schedule("chimera", placement, num_microbatches, tuple(map(tuple, rows)), pipelines)
