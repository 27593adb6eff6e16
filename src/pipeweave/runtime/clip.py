"""Global gradient-norm clipping over tensor-parallel shards and data-parallel replicas, as one model's would be.

``--clip-grad-norm`` with tensor or data parallelism (``TrainConfig.clips_by_collective``): at each stage's
``U``, after its replicas' gradients are combined (``runtime.replicas``), every process adds the squares of
the gradients it holds that no other process counts, one all-reduce (float64, over every process) sums them,
and every stage scales its gradients by ``torch.nn.utils.clip_grad_norm_``'s factor,
``min(1, max_norm / (norm + 1e-6))``. What each process counts, so that every element of the model counts
once (Megatron-LM's ``clip_grad_norm_fp32`` does the same):

- a tensor-parallel shard on every process of its group (the shards are distinct); a parameter every
  process of the group holds whole (norms, the embedding) on its ``tp`` rank 0 only;
- under ZeRO each replica's slices of the reduced gradient (distinct by construction: ``runtime.zero``'s
  slices at stage 1, FSDP2's rows at stage 3, ``runtime.fsdp``);
  without ZeRO the reduced gradient, equal on every replica, on ``dp`` rank 0 only -- an expert-parallel
  share of the experts (``stage.expert_parallel``) on the first replica holding it, ``dp`` rank < E;
- of tied embedding and head (``runtime.stage.tied``), which hold one shared gradient, the embedding's;
- under context parallelism, where every process of a ``cp`` group holds the same gradients once they are
  summed over it (``runtime.stage.context_parallel``, before the clipping), on its ``cp`` rank 0 only.

The norm needs every stage's gradients, so each ``U`` waits for the whole pipeline's backward (the barrier
Megatron-LM pays too; post-validation, ``runtime.stage.post_validation``, avoids it where it applies: one
pipeline of whole layers). One ``U`` per process per step (one stage per rank), so every process calls the
all-reduce once per step, in the same place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from pipeweave.runtime.fsdp import FullyShardedPart
from pipeweave.runtime.stage.expert_parallel import is_expert
from pipeweave.runtime.stage.tensor_parallel import split_of
from pipeweave.runtime.stage.tied import repeated_members
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.transport.mesh import Mesh
from pipeweave.runtime.zero import ZeroOptimizer


class GlobalNormClip:
    """Clips the gradients of this process's stages at their ``U`` to a global norm (module docstring).

    The executor runs ``hooks`` last at each ``U``, after the replicas' and the ties' sums.

    Args:
        max_norm: the largest global gradient norm.
        workers: this process's stage workers (one per process: the plan checks it).
        joined: this process's mesh (``RankContext.mesh``; None: no tensor or data parallelism).

    Attributes:
        norms: per ``U`` of this process, the global gradient norm before clipping.
        hooks: per stage, what its ``U`` runs (``StageWorker.update(combine=...)``).
    """

    def __init__(self, max_norm: float, workers: dict[int, StageWorker], joined: Mesh | None = None) -> None:
        self.max_norm = max_norm
        self.tp_rank, self.dp_rank = (0, 0) if joined is None else (joined.tp_rank, joined.dp_rank)
        self.counts = joined is None or joined.cp_rank == 0  # a cp group's gradients are alike: its rank 0's count
        self.expert_parallel = 1 if joined is None else joined.expert_parallel
        self.norms: list[float] = []
        # The gradients the optimizer applies are clipped: replicas summed (or sliced), ties summed first.
        self.hooks: dict[int, Callable[[StageWorker], None]] = {stage: self._clip for stage in workers}

    def _clip(self, worker: StageWorker) -> None:
        squares = torch.zeros(1, dtype=torch.float64, device=worker.device)
        for grad in _distinct(worker, self.tp_rank, self.dp_rank, self.expert_parallel) if self.counts else ():
            squares += grad.double().pow(2).sum()
        dist.all_reduce(squares)
        norm = math.sqrt(float(squares))
        self.norms.append(norm)
        # torch.nn.utils.clip_grad_norm_'s factor, in float32 as it computes it
        factor = torch.clamp(self.max_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
        for grad in applied_gradients(worker):
            grad.mul_(factor.to(grad.device))


def applied_gradients(worker: StageWorker) -> list[torch.Tensor]:
    """The gradients the worker's optimizer steps on: ZeRO's slices, or the parameters' own."""
    optimizer = worker.optimizer
    if isinstance(worker.shards, FullyShardedPart):
        return worker.shards.local_gradients()
    if isinstance(optimizer, ZeroOptimizer):
        return [shard.grad for shard in optimizer.shards if shard.grad is not None]
    return worker.gradients()


def _distinct(worker: StageWorker, tp_rank: int, dp_rank: int, expert_parallel: int = 1) -> Iterator[torch.Tensor]:
    """The gradients (or pieces) this process counts in the global norm, no element counted twice anywhere."""
    tied = repeated_members(worker)  # of a tied group, the first member counts for all
    optimizer = worker.optimizer

    def counted(param: torch.Tensor) -> bool:
        return id(param) not in tied and (split_of(param) is not None or tp_rank == 0)

    if isinstance(optimizer, ZeroOptimizer) or isinstance(worker.shards, FullyShardedPart):
        owner = worker.shards if isinstance(worker.shards, FullyShardedPart) else optimizer
        yield from (piece for param, piece in owner.owned_gradients() if counted(param))
    else:
        first = (p for p in worker.module.parameters() if (dp_rank < expert_parallel if is_expert(p) else dp_rank == 0))
        yield from (p.grad for p in first if p.grad is not None and counted(p))
