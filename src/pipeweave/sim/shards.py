"""Model-state memory per rank: parameters, gradients and optimizer state, sharded by TP and by ZeRO's stages.

One TP rank holds 1/N of a part's split parameters and all of its replicated
ones (embeddings, norms: ``ModelBytes.replicated``), with their gradients and
optimizer state. ZeRO (Rajbhandari et al., SC20) then shards that over the P
data-parallel replicas:

| ZeRO | parameters | gradients | optimizer state |
|---|---|---|---|
| 0 | 1 | 1 | 1 |
| 1 | 1 | 1 | 1/P |
| 3 | 1/P | 1/P | 1/P |

Stage 3's parameters are counted at rest; the gathered copy of the part being
computed is transient and left to the caller's allowance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeweave.schedule.ir import Schedule
from pipeweave.sim.cost import CostModel
from pipeweave.sim.metrics import version_metrics
from pipeweave.sim.parallel import Layout
from pipeweave.sim.traffic import ModelBytes


@dataclass(frozen=True)
class Shares:
    """The fraction of one TP rank's parameter, gradient and optimizer-state bytes that one GPU holds (ZeRO).

    Example:
        >>> Shares.of(Layout(tp=2, dp=4, zero=1))
        Shares(params=1.0, grads=1.0, optimizer=0.25)
    """

    params: float
    grads: float
    optimizer: float

    @classmethod
    def of(cls, layout: Layout) -> Shares:
        if layout.zero == 0:
            return cls(1.0, 1.0, 1.0)
        shard = 1.0 / layout.dp
        return cls(1.0, 1.0, shard) if layout.zero == 1 else cls(shard, shard, shard)


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
    tp_rank = [parts.tp_rank_params(k, layout.tp) for k in range(num_parts)]
    costs = CostModel(weight=[p * share.params for p in tp_rank]).for_parts(num_parts=num_parts, num_ranks=num_ranks)
    params = version_metrics(schedule, costs)[0]
    grads = stage_sum(schedule, [p * parts.grads * share.grads for p in tp_rank])
    optimizer = stage_sum(schedule, [p * parts.optimizer * share.optimizer for p in tp_rank])
    return tuple(RankMemory(p, g, o) for p, g, o in zip(params, grads, optimizer))


def stage_sum(schedule: Schedule, per_part: Sequence[float]) -> tuple[float, ...]:
    """Per rank, ``per_part`` summed over the stages it holds."""
    sums = [0.0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement.stage_rank):
        sums[rank] += per_part[schedule.placement.stage_part[stage]]
    return tuple(sums)
