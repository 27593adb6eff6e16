"""``pipeweave.Pipeline``: one rank's part of a pipelined model, driven one training step at a time by the
user's own loop, as torch.distributed.pipelining's ``schedule.step()``.

Built on every rank of an initialised process group (torchrun, or processes
the user started), it does what ``job.run_rank`` does before its loop -- the
plan agreed with rank 0, the mesh joined, the stage workers and the
executor built -- and ``step(batch)`` is one turn of that loop: the batch
split into T microbatches, the rank's actions run, the learning rate of
the step set and a non-finite loss stopped or skipped as ``pipeweave train``
does. What the loop around it does (how many steps, which data, evaluating,
saving) is the user's.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.config import TrainConfig
from pipeweave.data import split_microbatches
from pipeweave.errors import UserError
from pipeweave.models import boundary
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.process import device_for
from pipeweave.runtime.run.agreement import agreed_plan
from pipeweave.runtime.run.divergence import Divergence
from pipeweave.runtime.run.job import executor_of, lowered
from pipeweave.runtime.run.prepare import learning_rates, prepare
from pipeweave.runtime.run.workers import build_workers, join_mesh
from pipeweave.runtime.stage.lr_schedule import set_lr

_RUN_ONLY = (("save", "--save"), ("resume", "--resume"), ("eval_every", "--eval-every"), ("log_dir", "--log-dir"))
"""Options of a whole run (``pipeweave.train``): the loop that would honour them is the user's."""


class Pipeline:
    """This rank's stages of a synchronous pipeline schedule, trained one mini-batch per ``step`` call.

    Args:
        config: the run (``TrainConfig``): model, schedule, sizes, optimizer. Every rank passes the same.
            ``steps`` only shapes a learning-rate schedule; ``save``, ``resume``, ``eval_every`` and ``log_dir``
            belong to ``pipeweave.train``.

    Raises:
        UserError: no process group, a world of the wrong size, an asynchronous schedule (a stream spans steps:
            ``pipeweave.train`` runs it), or a whole-run option.

    Example:
        >>> import torch.distributed as dist   # on every rank, e.g. under torchrun --nproc-per-node 2
        >>> dist.init_process_group("gloo")   # doctest: +SKIP
        >>> pipe = Pipeline(TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=4))  # doctest: +SKIP
        >>> for inputs, targets in batches:   # doctest: +SKIP
        ...     loss = pipe.step((inputs, targets))   # a float on the ranks of the last stage, else None
    """

    def __init__(self, config: TrainConfig) -> None:
        _check(config)
        plan = agreed_plan(prepare(config))  # every rank builds rank 0's split, or all stop in one line
        world = dist.get_world_size()
        if world != plan.num_processes:
            raise UserError(
                f"the process group has {world} processes but the run needs {plan.num_processes} "
                f"(schedule ranks x tensor parallel); start {plan.num_processes} processes"
            )
        self.config, self.schedule = config, plan.schedule
        process = dist.get_rank()
        context = join_mesh(
            plan,
            RankContext(
                process=process,
                world=world,
                device=device_for(process),
                timeout=datetime.timedelta(seconds=config.launch.timeout),
            ),
        )
        self.device = context.device
        if self.device.type == "cuda":  # NCCL's messages and collectives go from the current device
            torch.cuda.set_device(self.device)
        self.rank = context.stage_rank
        """This process's rank in the schedule."""
        self._group = context.pipeline_group
        low, stash = lowered(plan)
        self._workers = build_workers(plan, self.rank, self.device, context=context, row=low.actions[self.rank])
        self._executor, _ = executor_of(plan, context, self._workers, low, stash)
        self._divergence = Divergence(plan, self._workers)
        self._rates = learning_rates(config) if config.training.lr_scheduled else None
        self.steps_done = 0
        """Steps trained so far."""
        placement = plan.schedule.placement
        last = [s for s in range(placement.num_stages) if placement.stage_part[s] == placement.num_parts - 1]
        self.has_loss = any(placement.stage_rank[s] == self.rank for s in last)
        """This rank holds a last stage: ``step`` returns the loss here."""
        self._shared = len({placement.stage_rank[s] for s in last}) > 1

    @property
    def stages(self) -> dict[int, torch.nn.Module]:
        """This rank's stages by stage index, each the ``nn.Module`` of its layers (its parameters trained)."""
        return {s: w.module for s, w in self._workers.items()}

    def step(self, batch: tuple[Any, Any]) -> float | None:
        """Train on one mini-batch: ``batch = (inputs, targets)``, split into T microbatches along dimension 0.

        Every rank calls it with the same mini-batch (only the ranks of the first and last stages read it).
        Returns, as torch.distributed.pipelining gives its losses on the last stage, the mini-batch's mean loss
        on the ranks holding a last stage (``has_loss``) and None elsewhere.

        Raises:
            UserError: fewer samples than microbatches; ``errors.Diverged``: a non-finite loss, as
                ``--on-nonfinite`` says.
        """
        inputs, targets = batch
        if self._rates is not None:
            for w in self._workers.values():
                set_lr(w.optimizer, self._rates.at(self.steps_done))
        xs, ys = self._microbatches(inputs, targets)
        share, _ = self._executor.run_step(xs, ys)
        self._divergence.after_step(self.steps_done, self._executor.step_loss, self._executor.overflowed)
        self.steps_done += 1
        loss = self._summed(share) if self._shared else share
        return loss if self.has_loss else None

    def _microbatches(self, inputs: Any, targets: Any) -> tuple[list[Any], list[Any]]:
        """The T microbatches of the inputs and targets on this rank's device (none where no stage reads them)."""
        if not any(w.is_first or w.is_last for w in self._workers.values()):
            return [], []
        t = self.schedule.num_microbatches
        return (
            [boundary.to(m, self.device) for m in split_microbatches(inputs, t)],
            [boundary.to(m, self.device) for m in split_microbatches(targets, t)],
        )

    def _summed(self, share: float) -> float:
        """The loss where several ranks hold last stages (replicas of the last part): every pipeline rank's
        share, summed in rank order as ``RunRecord.losses`` sums them."""
        mine = torch.tensor([share], dtype=torch.float64, device=self.device)  # NCCL: on the GPU
        shares = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(shares, mine, group=self._group)
        return sum(float(s) for s in shares)


def _check(config: TrainConfig) -> None:
    """What a step-at-a-time pipeline cannot take, each one line.

    Raises:
        UserError: no process group, an asynchronous schedule, or a whole-run option.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise UserError(
            "Pipeline needs a process group on every rank: run under torchrun, or call "
            "torch.distributed.init_process_group first (pipeweave.train starts its own ranks)"
        )
    if config.is_stream:
        raise UserError(
            f"{config.schedule.name} is asynchronous: its stream spans steps and cannot stop after each; "
            "train it with pipeweave.train, or choose a synchronous schedule"
        )
    for field, flag in _RUN_ONLY:
        if getattr(config, field) is not None:
            raise UserError(
                f"{flag} is an option of a whole run (pipeweave.train); with Pipeline your loop "
                f"saves, resumes, evaluates and logs: drop {flag}"
            )
