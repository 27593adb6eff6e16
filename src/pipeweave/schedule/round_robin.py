"""PipeDream's replicated stages, 1F1B-RR (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism
for DNN Training", SOSP 2019, sections 3.1-3.3).

PipeDream's planner (``partition.pipedream``) may give part k to r_k ranks,
its replicas, each taking every r_k-th microbatch: microbatch m runs part k on
replica ``m mod r_k`` for its forward and its backward (the paper's
deterministic round-robin, "1F1B-RR"), so a replica sees 1/r_k of the stream
and the part keeps pace with the unreplicated ones. Legend: W_k = r_k + ... +
r_{K-1}, the ranks from part k on; NOAM = ceil(W_0 / r_0) microbatches in
flight at each input replica.

Stage ids run part by part (replica i of part k is stage ``r_0 + ... +
r_{k-1} + i``, on the rank of the same number), and microbatch m follows
pipeline ``m mod lcm(r)``: a part of one replica lies on every pipeline (a
shared stage, ``Placement.shared``). Each replica runs 1F1B over its own
microbatches, ``ceil(W_k / r_k)`` of them in flight (D - k on a straight
pipeline; with fewer admitted, ``ceil((admitted r_0 - (W_0 - W_k)) / r_k)``),
and updates after each of its backwards; the
replicas of a part update together, their gradients averaged by an
all-reduce (``runtime.replicas``), so their weights stay identical and the
part's version is its update count, as on one rank.

Parts ``[2, 1]`` on three ranks (stage 2 takes every microbatch)::

    rank 0 | F0 F2 B0 U0 F4 B2 U1 ...
    rank 1 | F1 F3 B1 U0 F5 B3 U1 ...
    rank 2 | F0 B0 U0 F1 B1 U1 F2 B2 U2 ...
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, ScheduleError, WeightPolicy
from pipeweave.schedule.stream import stream_order


def check_replicas(replicas: Sequence[int], num_ranks: int, num_microbatches: int) -> None:
    """Refuse a replication the ranks cannot hold, or whose replicas would take unequal microbatches.

    Raises:
        ScheduleError: a count < 1, counts not summing to the ranks, or T not a multiple of a count.
    """
    text = ",".join(map(str, replicas))
    if not replicas or any(not isinstance(r, int) or r < 1 for r in replicas):
        raise ScheduleError(f"stage replicas {text or '(none)'} are invalid; give one count >= 1 per part, e.g. 2,1")
    if sum(replicas) != num_ranks:
        raise ScheduleError(
            f"stage replicas {text} need {sum(replicas)} processes but the pipeline has {num_ranks}; "
            f"give --stages {sum(replicas)} or counts summing to {num_ranks}"
        )
    uneven = [r for r in replicas if num_microbatches % r]
    if uneven:
        raise ScheduleError(
            f"{num_microbatches} microbatches do not deal evenly to {uneven[0]} replicas; give --microbatches "
            f"a multiple of {math.lcm(*replicas)}"
        )


def round_robin_placement(replicas: Sequence[int]) -> Placement:
    """Part k on ``replicas[k]`` ranks, stage = rank, pipeline p through replica ``p mod r_k`` of each part.

    Example:
        >>> p = round_robin_placement([2, 1])
        >>> p.stage_part, p.pipelines, p.replicas(0)
        ((0, 0, 1), ((0, 2), (1, 2)), (0, 1))
    """
    first = [sum(replicas[:k]) for k in range(len(replicas))]
    stages = tuple(range(sum(replicas)))
    parts = tuple(k for k, r in enumerate(replicas) for _ in range(r))
    lines = tuple(tuple(first[k] + p % r for k, r in enumerate(replicas)) for p in range(math.lcm(*replicas)))
    return Placement(stages, parts, lines)


def replica_in_flight(replicas: Sequence[int], admitted: int) -> list[int]:
    """Per part, the microbatches each of its replicas holds between F and B, ``admitted`` at the input's.

    Example:
        >>> replica_in_flight([2, 1], 2), replica_in_flight([1, 1, 1], 3), replica_in_flight([1, 2], 3)
        ([2, 1], [3, 2, 1], [3, 1])
        >>> replica_in_flight([1, 1, 1], 2), replica_in_flight([2, 2], 1)  # fewer admitted: D - k less
        ([2, 1, 1], [1, 1])
    """
    after = [sum(replicas[k:]) for k in range(len(replicas))]  # W_k
    return [
        max(1, min(-(-w // r), -(-(admitted * replicas[0] - (after[0] - w)) // r))) for w, r in zip(after, replicas)
    ]


def round_robin_rows(replicas: Sequence[int], total: int, admitted: int, update_every: int) -> list[list[Action]]:
    """Per rank, 1F1B over its replica's microbatches (m mod r_k), a U after every ``update_every`` backwards.

    Example:
        >>> [" ".join(str(a)[1:] for a in row[:7]) for row in round_robin_rows([2, 1], 6, 2, 1)]
        ['F0 F2 B0 U0 F4 B2 U1', 'F1 F3 B1 U0 F5 B3 U1', 'F0 B0 U0 F1 B1 U1 F2']
    """
    rows = []
    for (part, r), held in zip(enumerate(replicas), replica_in_flight(replicas, admitted)):
        for i in range(r):
            stage = sum(replicas[:part]) + i
            own = list(range(i, total, r))
            row, done = [], 0
            for op, n in stream_order(held - 1, len(own)):
                row.append(Action(stage, op, own[n]))
                if op is Op.B:
                    done += 1
                    if done % update_every == 0 or done == len(own):
                        row.append(Action(stage, Op.U, (done - 1) // update_every))
            rows.append(row)
    return rows


def averages_replicas(schedule: Schedule) -> bool:
    """Whether the replicas of a part in this stream average their gradients at every ``U`` (1F1B-RR's, as
    PipeDream's replicated stages do; AvgPipe's replicas train apart and average their weights instead).

    Example:
        >>> from pipeweave.schedule import generate
        >>> averages_replicas(generate("pipedream", num_stages=3, num_microbatches=2, replicas=(2, 1)))
        True
        >>> averages_replicas(generate("pipedream", num_stages=3, num_microbatches=2))
        False
    """
    placement = schedule.placement
    replicated = any(len(placement.replicas(s)) > 1 for s in range(placement.num_stages))
    return replicated and not schedule.is_synchronous and schedule.policy is not WeightPolicy.AVERAGING


def minibatch_pipelines(schedule: Schedule) -> int:
    """How many pipelines take mini-batches of their own: AvgPipe's P; 1 where the pipelines are the routes of one
    mini-batch's microbatches (1F1B-RR's replicas, ``averages_replicas``) or there is one pipeline."""
    return 1 if averages_replicas(schedule) else len(schedule.placement.pipelines)
