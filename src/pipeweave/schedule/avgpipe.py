"""AvgPipe (Chen et al., PPoPP 2023, "Elastic Averaging for Efficient Pipelined DNN Training").

P pipelines share the same D ranks: stage p D + i holds part i on rank i, so
each rank hosts P replicas of its part. Each pipeline trains its own replica on
its own mini-batches of T microbatches, synchronously within the pipeline (a
replica finishes a mini-batch and updates before its next forwards), and the
pipelines fill each other's bubbles. The replicas are kept together by elastic
averaging (``weights.avgpipe``), a rank-local operation here since all replicas
of a part live on one rank (policy AVERAGING).

Global microbatch j belongs to step j // (P T) and to pipeline (j // T) mod P:
a step is P mini-batches, one per pipeline. The order comes from
``stream.greedy_stream`` at f = 1, B = 2; each stage keeps at most D - i
microbatches in flight at pipeline position i (1F1B's bound).

``own_ranks=True`` is the paper's layout: pipeline p on ranks p D .. p D + D - 1
of its own (P x D ranks, one replica of a part per rank, M_theta per rank and
P M_theta across the machine), each running its mini-batches in the order a
lone pipeline of the layout above would (P = 1), and the replicas of a part
averaged by a collective between their ranks (``runtime.stage.averaging``). The
averaging does not hold a pipeline back: the next mini-batch's forwards run
while it is in flight, and its result is applied at the stage's next update
(the paper's advancing forward pass).
"""

from __future__ import annotations

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, WeightPolicy, check_positive
from pipeweave.schedule.stream import DEFAULT_NUM_STEPS, add_updates, check_stream, every, greedy_stream

DEFAULT_PIPELINES = 2
"""P: the paper tunes it by profiling; 2 is the smallest that shows the averaging."""


def replicated_placement(num_ranks: int, num_pipelines: int) -> Placement:
    """P straight pipelines on the same D ranks: stage p D + i holds part i on rank i."""
    stages = [(p, i) for p in range(num_pipelines) for i in range(num_ranks)]
    pipelines = tuple(tuple(p * num_ranks + i for i in range(num_ranks)) for p in range(num_pipelines))
    return Placement(tuple(i for _, i in stages), tuple(i for _, i in stages), pipelines)


def own_ranks_placement(num_ranks: int, num_pipelines: int) -> Placement:
    """P straight pipelines on ranks of their own: stage p D + i holds part i on rank p D + i.

    Example:
        >>> own_ranks_placement(2, 2).stage_part, own_ranks_placement(2, 2).num_ranks
        ((0, 1, 0, 1), 4)
    """
    shared = replicated_placement(num_ranks, num_pipelines)
    return Placement(tuple(range(num_ranks * num_pipelines)), shared.stage_part, shared.pipelines)


def avgpipe(
    num_stages: int,
    num_microbatches: int,
    *,
    num_steps: int = DEFAULT_NUM_STEPS,
    num_pipelines: int = DEFAULT_PIPELINES,
    own_ranks: bool = False,
) -> Schedule:
    """AvgPipe's stream: P replicated pipelines interleaved on D ranks.

    Args:
        num_stages: D, ranks (and parts) per pipeline.
        num_microbatches: T, microbatches per mini-batch of one pipeline.
        num_steps: steps in the stream; each step is one mini-batch per pipeline (default 4).
        num_pipelines: P (default 2).
        own_ranks: each pipeline on D ranks of its own (P x D ranks, the paper's layout).

    Example:
        >>> s = avgpipe(2, 2, num_steps=1)
        >>> s.placement.stage_rank, s.microbatch_pipeline
        ((0, 1, 0, 1), (0, 0, 1, 1))
    """
    check_stream(num_stages, num_microbatches, num_steps)
    check_positive("num_pipelines", num_pipelines, "give num_pipelines >= 1 (P replicated pipelines)")
    d, t, p = num_stages, num_microbatches, num_pipelines
    if own_ranks:
        return _own_ranks(d, t, num_steps, p)
    total = num_steps * p * t
    placement = replicated_placement(d, p)
    owner = tuple((j // t) % p for j in range(total))
    position = {s: i for line in placement.pipelines for i, s in enumerate(line)}

    def replica_in_order(stage: int, j: int, backwards_done: int) -> bool:
        return backwards_done >= (j // (p * t)) * t  # a replica's earlier mini-batches are done

    rows = greedy_stream(
        placement,
        [placement.pipelines[owner[j]] for j in range(total)],
        lambda s: d - position[s],
        replica_in_order,
    )
    rows = add_updates(rows, every(t, total))
    return Schedule(
        "avgpipe",
        placement,
        total,
        tuple(map(tuple, rows)),
        microbatch_pipeline=owner,
        policy=WeightPolicy.AVERAGING,
        num_steps=num_steps,
    )


def _own_ranks(d: int, t: int, num_steps: int, p: int) -> Schedule:
    """Pipeline q's ranks run a lone pipeline's order on its mini-batches m P + q (global microbatches)."""
    lone = avgpipe(d, t, num_steps=num_steps, num_pipelines=1)
    rows = []
    for q in range(p):
        for row in lone.actions:
            rows.append(
                tuple(
                    Action(q * d + a.stage, a.op, a.microbatch if a.op is Op.U else _global(a.microbatch, t, p, q))
                    for a in row
                )
            )
    total = num_steps * p * t
    return Schedule(
        "avgpipe",
        own_ranks_placement(d, p),
        total,
        tuple(rows),
        microbatch_pipeline=tuple((j // t) % p for j in range(total)),
        policy=WeightPolicy.AVERAGING,
        num_steps=num_steps,
    )


def _global(j: int, t: int, p: int, q: int) -> int:
    """Pipeline q's j-th microbatch: microbatch j mod T of its (j // T)-th mini-batch, global mini-batch m P + q."""
    return ((j // t) * p + q) * t + j % t
