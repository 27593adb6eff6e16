"""Non-finite values found by every rank at once: a step's loss, a stream's losses, the weights of each part.

The loss of a step is computed on the last stages only (``Executor.forward``);
the weights of a part live on its ranks only. To stop a diverging run on
every rank at the same step, to skip a step's update on every stage, or to
refuse a checkpoint of non-finite weights (``runtime.run.divergence``), the
ranks must agree on what is finite -- or one rank would stop while the
others wait for it.

``LossAgreement`` does it for synchronous steps with one asynchronous
all-reduce of one float64 per step, posted early and waited late:

- a rank without a last stage posts its zero when the step begins;
- a rank with last stages posts its share of the loss as soon as its last
  loss of the step is computed;
- every rank waits for the sum at its first ``U`` of the step where the
  update depends on it (``skip``), otherwise at the end of the step.

Every ``U`` of a synchronous step comes after the stage's backwards, which
come after the last stages' forwards of the same microbatches: when a rank
reaches its first ``U`` (or its step's end) every rank has posted, so the
wait is the collective's latency, mostly elapsed in the background, not a
barrier -- no rank waits for another to finish its step, and the overlap of
a step's tail with the next step's warm-up (zero-bubble schedules) is kept.
What it costs is measured in ``benchmarks/runtime/README.md``.

``summed_losses`` (a drained stream's per-mini-batch losses) and
``nonfinite_parts`` (before a checkpoint and at the end of a run) are one
blocking all-reduce each, where nothing is in flight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.runtime.stage.shards import gathered
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Action, Op, Placement


class LossAgreement:
    """One rank's side of the per-step loss all-reduce (see the module docstring).

    Args:
        row: this rank's lowered actions of one step.
        placement: the schedule's placement (which stages are last).
        device: where the all-reduced number lives (CUDA under NCCL, the CPU under gloo).
        group: the processes of this ``tp`` coordinate (``RankContext.pipeline_group``; None: the default group):
            each stage rank's share counted once, not once per tensor-parallel process.
    """

    def __init__(self, row: Sequence[Action], placement: Placement, device: torch.device, group: Any = None) -> None:
        self.group = group
        self.expected = sum(1 for a in row if a.op is Op.F and placement.next_stage(a.stage) is None)
        """Losses this rank computes per step (its last stages' forwards)."""
        self.device = device
        self._share: torch.Tensor | None = None
        self._work: Any = None
        self._total: float | None = None

    def begin_step(self) -> None:
        """A step begins: a rank that computes no loss posts its zero share now."""
        self._share, self._work, self._total = None, None, None
        if self.expected == 0:
            self._post(torch.zeros(1, dtype=torch.float64, device=self.device))

    def loss_added(self, losses: Sequence[torch.Tensor]) -> None:
        """After every loss this rank computes (``losses``: the step's so far): the last one posts the share."""
        if len(losses) == self.expected:
            self._post(torch.stack(list(losses)).sum().to(torch.float64).reshape(1))

    def total(self) -> float:
        """The step's loss, every rank's share summed (waits for the all-reduce once per step)."""
        if self._total is None:
            assert self._work is not None and self._share is not None, "total() before this rank posted its share"
            self._work.wait()
            self._total = float(self._share)
        return self._total

    def _post(self, share: torch.Tensor) -> None:
        self._share = share
        self._work = dist.all_reduce(share, group=self.group, async_op=True)  # each stage rank once


def summed_losses(shares: Sequence[float], device: torch.device, group: Any = None) -> list[float]:
    """Every rank's per-mini-batch loss shares summed (one blocking all-reduce; every rank calls it)."""
    total = torch.tensor(list(shares), dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)  # each stage rank once, not once per tensor-parallel rank
    return total.tolist()


def nonfinite_parts(workers: Mapping[int, StageWorker], placement: Placement) -> list[int]:
    """The parts, on any rank, holding a non-finite parameter (one blocking all-reduce; every rank calls it)."""
    device = next(iter(workers.values())).device if workers else torch.device("cpu")
    flags = torch.zeros(placement.num_parts, dtype=torch.float64, device=device)
    with gathered(workers):  # ZeRO-3's parameters whole
        for stage, worker in workers.items():
            params = list(worker.module.parameters())
            if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
                flags[placement.stage_part[stage]] = 1.0
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [part for part, flag in enumerate(flags.tolist()) if flag]
