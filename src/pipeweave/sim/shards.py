"""Model-state memory per rank: parameters, gradients and optimizer state, sharded by TP and by ZeRO's stages.

A stage's parameters are split over its N tensor-parallel ranks (every weight
is taken as TP-sharded; Megatron-LM splits all but norms and biases). ZeRO
(Rajbhandari et al., SC20) then shards over the P data-parallel replicas:

| ZeRO | parameters | gradients | optimizer state |
|---|---|---|---|
| 0 | 1/N | 1/N | 1/N |
| 1 | 1/N | 1/N | 1/(N P) |
| 3 | 1/(N P) | 1/(N P) | 1/(N P) |

Stage 3's parameters are counted at rest; the gathered copy of the part being
computed is transient and left to the caller's allowance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeweave.schedule.ir import Schedule
from pipeweave.sim.cost import CostModel
from pipeweave.sim.metrics import version_metrics
from pipeweave.sim.parallel import Layout, ModelBytes


@dataclass(frozen=True)
class Shares:
    """The fraction of a part's parameter, gradient and optimizer-state bytes that one rank holds.

    Example:
        >>> Shares.of(Layout(tp=2, dp=4, zero=1))
        Shares(params=0.5, grads=0.5, optimizer=0.125)
    """

    params: float
    grads: float
    optimizer: float

    @classmethod
    def of(cls, layout: Layout) -> Shares:
        tp, all_ = 1.0 / layout.tp, 1.0 / (layout.tp * layout.dp)
        if layout.zero == 0:
            return cls(tp, tp, tp)
        if layout.zero == 1:
            return cls(tp, tp, all_)
        return cls(all_, all_, all_)


@dataclass(frozen=True)
class RankMemory:
    """Bytes of model state one GPU holds."""

    params: float
    """Parameters, with every weight copy the schedule's policy keeps (PipeDream's stash: several)."""
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total}


def rank_memory(schedule: Schedule, layout: Layout, model: ModelBytes) -> tuple[RankMemory, ...]:
    """Per pipeline rank, the model-state bytes each of its N x P GPUs holds.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = generate("1f1b", num_stages=2, num_microbatches=4)
        >>> m = rank_memory(s, Layout(tp=2, dp=2, zero=1), ModelBytes(params=8.0, grads=1.0, optimizer=2.0))
        >>> m[0].as_dict()
        {'params': 4.0, 'grads': 4.0, 'optimizer': 4.0, 'total': 12.0}
    """
    num_ranks, num_parts = schedule.placement.ranks_per_pipeline, schedule.num_parts
    parts = model.for_parts(num_parts=num_parts, num_ranks=num_ranks)
    share = Shares.of(layout)
    held = tuple(p * share.params for p in parts.params)
    costs = CostModel(weight=held).for_parts(num_parts=num_parts, num_ranks=num_ranks)
    params = version_metrics(schedule, costs)[0]
    grads = stage_sum(schedule, [p * parts.grads * share.grads for p in parts.params])
    optimizer = stage_sum(schedule, [p * parts.optimizer * share.optimizer for p in parts.params])
    return tuple(RankMemory(p, g, o) for p, g, o in zip(params, grads, optimizer))


def stage_sum(schedule: Schedule, per_part: Sequence[float]) -> tuple[float, ...]:
    """Per rank, ``per_part`` summed over the stages it holds."""
    sums = [0.0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement.stage_rank):
        sums[rank] += per_part[schedule.placement.stage_part[stage]]
    return tuple(sums)
