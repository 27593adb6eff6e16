"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21).

Legend: D ranks, T microbatches, v chunks per rank; the model is cut into D x v
parts and part k lives on rank k mod D (``Placement.looped``), so a microbatch
loops v times through the ranks. Each rank walks its v x T *virtual
microbatches* (chunk, microbatch) in Megatron's order: microbatches in groups
of D, and within a group chunk 0 of all of them, then chunk 1, ...; backwards
walk the same order with the chunks reversed. Rank r warms up with
2 (D-r-1) + (v-1) D forwards, then alternates one forward and one backward,
then drains. D = 2, v = 2, T = 2 (stages 0, 1 on ranks 0, 1 in chunk 0 and
stages 2, 3 in chunk 1)::

    rank 0 | 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
    rank 1 | 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1

Accepted configurations: any D >= 1, v >= 1, and T >= 1 a multiple of D when
v > 1 (Megatron's classic condition: other T either deadlock in this order or
lose the closed form; with v = 1 the schedule is exactly ``1f1b``, any T).

Closed forms (uniform per-part costs f, b, w, no communication, all accepted
configurations): ``bubble_overhead`` = (D-1)/(v T) exactly, for any f, b, w;
rank r holds at most min(2 (D-r-1) + (v-1) D + 1, v T) chunk activations of
M_a / v each, D + (D-1)/v M_a on rank 0 when T >= 2D (v > 1).
"""

from __future__ import annotations

from pipeweave.schedule.ir import (
    Action,
    Op,
    Placement,
    Schedule,
    ScheduleError,
    append_updates,
    check_positive,
)
from pipeweave.schedule.one_f_one_b import one_f_one_b_order


def virtual_microbatches(num_ranks: int, num_microbatches: int, num_chunks: int) -> list[tuple[int, int]]:
    """Megatron's forward order of ``(chunk, microbatch)`` pairs, the same on every rank.

    Example:
        >>> virtual_microbatches(2, 4, 2)
        [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    """
    order: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, num_ranks):
        group = range(first, min(first + num_ranks, num_microbatches))
        order += [(chunk, j) for chunk in range(num_chunks) for j in group]
    return order


def interleaved_order(rank: int, num_ranks: int, num_microbatches: int, num_chunks: int) -> list[Action]:
    """The F/B actions of one rank of interleaved 1F1B, in order."""
    d, v = num_ranks, num_chunks
    if v == 1:  # one chunk: Megatron runs plain 1F1B (its warm-up is D-r-1, not 2(D-r-1))
        return [Action(rank, op, j) for op, j in one_f_one_b_order(rank, d, num_microbatches)]
    virtual = virtual_microbatches(d, num_microbatches, v)
    forwards = [Action(chunk * d + rank, Op.F, j) for chunk, j in virtual]
    backwards = [Action((v - 1 - chunk) * d + rank, Op.B, j) for chunk, j in virtual]
    # Why 2(D-r-1) + (v-1)D: chunk 0's activations for the first group must reach
    # the last rank and come back as chunk 1's input before rank r may start a
    # backward, and the first backward of the group arrives D-r-1 steps later still.
    warmup = min(len(forwards), 2 * (d - rank - 1) + (v - 1) * d)
    row = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        row += [forwards[warmup + k], backwards[k]]
    return row + backwards[len(forwards) - warmup :]


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """Megatron-LM's interleaved 1F1B: v chunks per rank on a looped placement.

    Args:
        num_stages: D, ranks in the pipeline.
        num_microbatches: T; a multiple of D when ``num_chunks`` > 1.
        num_chunks: v, chunks (model parts) per rank.

    Raises:
        ScheduleError: a non-positive value, or T not a multiple of D with v > 1.

    Example:
        >>> s = interleaved_1f1b(2, 2, num_chunks=2)
        >>> [str(a) for a in s.actions[1]]
        ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1', '1U0', '3U0']
    """
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    check_positive("num_chunks", num_chunks)
    d, t, v = num_stages, num_microbatches, num_chunks
    if v > 1 and t % d:
        up = -(-t // d) * d
        raise ScheduleError(
            f"num_microbatches={t} is not a multiple of num_stages={d}, which interleaved-1f1b "
            f"needs with {v} chunks; use {up} microbatches (or --chunks 1)"
        )
    placement = Placement.looped(d, v)
    rows = [interleaved_order(r, d, t, v) for r in range(d)]
    append_updates(rows, placement)
    return Schedule("interleaved-1f1b", placement, t, tuple(map(tuple, rows)))
