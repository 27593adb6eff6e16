"""What a layout's communication costs one step: TP all-reduces per rank, the slowest pipeline message,
each part's DP reduction, how much of the reductions sticks out past the backward (``sim.parallel``), and
AvgPipe's averaging of the replicas of each part between pipelines on ranks of their own."""

from __future__ import annotations

from dataclasses import dataclass

from pipeweave.schedule.ir import Op, Schedule, WeightPolicy
from pipeweave.sim.bubble import bubble_metrics
from pipeweave.sim.cost import CostModel
from pipeweave.sim.network import all_reduce_time
from pipeweave.sim.parallel import (
    Layout,
    gather_time,
    hop_function,
    part_holders,
    reduction_times,
    simulate_layout,
    tp_backward_time,
    tp_forward_time,
)
from pipeweave.sim.traffic import ModelBytes, PartBytes


def tp_time_per_rank(schedule: Schedule, layout: Layout, parts: PartBytes) -> tuple[float, ...]:
    """Per rank, the time its F, I and B spend in TP all-reduces over the whole schedule."""
    num_ranks = schedule.placement.ranks_per_pipeline
    parts_ = range(len(parts.params))
    forward = [tp_forward_time(layout, parts, k, num_ranks=num_ranks) for k in parts_]
    backward = [tp_backward_time(layout, parts, k, num_ranks=num_ranks) for k in parts_]
    part_of = schedule.placement.stage_part
    return tuple(
        sum(forward[part_of[s]] if op is Op.F else backward[part_of[s]] for s, op, _ in row if op in (Op.F, Op.I, Op.B))
        for row in schedule.actions
    )


@dataclass(frozen=True)
class Communication:
    """The TP and DP communication of one step, for reports (seconds when the network's units are bytes/s)."""

    tp_per_rank: tuple[float, ...]
    """Per rank, time in TP all-reduces over the step (inside its F and I)."""
    hop: float
    """The slowest pipeline message (latency + bytes / bandwidth, ``comm`` included)."""
    reduction: tuple[float, ...]
    """Per part, its DP gradient reduction."""
    gather: tuple[float, ...]
    """Per part, ZeRO's parameter all-gather after ``U``."""
    exposed: float
    """What the DP reductions add to the step: its makespan minus the makespan with them free."""
    averaging: tuple[float, ...] = ()
    """AvgPipe on ranks of their own: per part, the all-reduce of its parameters over its P replicas' ranks
    that each averaging round costs (``averaging_times``); empty for every other schedule."""

    def as_dict(self) -> dict[str, object]:
        return {
            "tp_per_rank": list(self.tp_per_rank),
            "pipeline_hop": self.hop,
            "dp_reduction": list(self.reduction),
            "zero_gather": list(self.gather),
            "dp_exposed": self.exposed,
            "avg_all_reduce": list(self.averaging),
        }


def averaging_times(schedule: Schedule, layout: Layout, parts: PartBytes) -> tuple[float, ...]:
    """AvgPipe with its P pipelines on ranks of their own (``avgpipe(..., own_ranks=True)``): per part, one
    all-reduce of its parameter bytes (one TP rank's) over the P ranks holding its replicas, on the link between
    the farthest two of them. It runs every ``--avg-every`` rounds, overlapped with the next mini-batch; empty
    for every other schedule (AvgPipe's shared ranks average in place).

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.network import Link, Network
        >>> net = Network(intra_node=Link(bandwidth=1.0), inter_node=Link(bandwidth=1.0))
        >>> s = generate("avgpipe", num_stages=2, num_microbatches=2, own_ranks=True)
        >>> parts = ModelBytes(params=4.0).for_parts(num_parts=2, num_ranks=2)
        >>> averaging_times(s, Layout(network=net), parts)  # ring all-reduce of 4 bytes on 2 ranks: 2 (2-1)/2 x 4
        (4.0, 4.0)
    """
    placement = schedule.placement
    if schedule.policy is not WeightPolicy.AVERAGING or placement.num_ranks == placement.ranks_per_pipeline:
        return ()
    out = []
    for part in range(schedule.num_parts):
        ranks = sorted({placement.stage_rank[s] for s in placement.replicas(placement.stage_part.index(part))})
        link = layout.hop_link(ranks[0], ranks[-1], num_ranks=placement.num_ranks)
        nbytes = parts.tp_rank_params(part, layout.tp)
        out.append(0.0 if link is None else all_reduce_time(nbytes, len(ranks), link))
    return tuple(out)


def communication(
    schedule: Schedule,
    cost: CostModel | None,
    layout: Layout,
    model: ModelBytes | None = None,
    *,
    makespan: float | None = None,
    split_compute: bool = True,
) -> Communication:
    """The communication of ``schedule`` on the layout (``makespan``: the full simulation's, if known).

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.network import Link, Network
        >>> net = Network(intra_node=Link(bandwidth=1.0), inter_node=Link(bandwidth=1.0))
        >>> s = generate("1f1b", num_stages=2, num_microbatches=2)
        >>> c = communication(s, None, Layout(dp=2, network=net), ModelBytes(params=2.0))
        >>> c.reduction, c.exposed  # the last part's reduction ends the step: all of it sticks out
        ((2.0, 2.0), 2.0)
    """
    num_ranks, num_parts = schedule.placement.ranks_per_pipeline, schedule.num_parts
    parts = (model or ModelBytes()).for_parts(num_parts=num_parts, num_ranks=num_ranks)
    comm = (cost or CostModel()).comm
    hop = hop_function(schedule, layout, parts, comm)
    pairs = {(a, b) for line in schedule.placement.pipelines for a, b in zip(line, line[1:])}
    if makespan is None:
        makespan = bubble_metrics(
            simulate_layout(schedule, cost, layout, model, check=False, split_compute=split_compute)
        )[0]
    free = bubble_metrics(
        simulate_layout(schedule, cost, layout, model, check=False, split_compute=split_compute, reduce=False)
    )[0]
    return Communication(
        tp_per_rank=tp_time_per_rank(schedule, layout, parts),
        hop=max(
            (hop(a, b) for a, b in pairs if schedule.placement.stage_rank[a] != schedule.placement.stage_rank[b]),
            default=0.0,
        ),
        reduction=reduction_times(schedule, layout, parts),
        gather=tuple(
            gather_time(layout, parts.tp_rank_params(k, layout.tp), num_ranks=num_ranks, holders=h)
            for k, h in enumerate(part_holders(schedule))
        ),
        exposed=max(0.0, makespan - free),
        averaging=averaging_times(schedule, layout, parts),
    )
