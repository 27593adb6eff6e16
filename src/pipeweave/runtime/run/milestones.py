"""Where a step (or a drained stream) of a run ends: evaluate and save, when due; and the data a rank loads."""

from __future__ import annotations

from typing import Any

import torch

from pipeweave.data import step_microbatches
from pipeweave.models import boundary
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.executor import Executor
from pipeweave.runtime.run import checkpoint
from pipeweave.runtime.run.prepare import RunPlan
from pipeweave.runtime.run.sizes import replica_microbatch_sizes
from pipeweave.runtime.stage.policy import StreamCarry
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.stream import replica_pieces
from pipeweave.schedule import Schedule, lower
from pipeweave.schedule.evaluation import forward_only


class Milestones:
    """What a rank does where a step (or a drained stream) of the run ends: evaluate and save, when due.

    ``--eval-every N`` evaluates after every N-th step of the run and after the
    last, through the forward-only pipeline of ``schedule`` (built at the first
    evaluation); ``--save``/``--save-every N`` write the checkpoint likewise.

    Attributes:
        eval_losses: per evaluation, ``(steps trained, this rank's share of the held-out loss)``.
        save_failures: per checkpoint that could not be written, the one line saying why; the run goes on
            (rank 0 reports one before the last step as ``{"checkpoint_failed": line}`` progress).
        final_save_failure: why the checkpoint after the last step could not be written (None: it was).
    """

    def __init__(
        self, plan: RunPlan, schedule: Schedule, context: RankContext, workers: dict[int, StageWorker], source: Any
    ) -> None:
        self.plan, self.schedule, self.rank, self.workers = plan, schedule, context.stage_rank, workers
        self.context, self.device, self.source = context, context.device, source
        self.eval_losses: list[tuple[int, float]] = []
        self.save_failures: list[str] = []
        self.final_save_failure: str | None = None
        self._evaluator: Executor | None = None
        self.loss_scale: Any = None
        """``--precision fp16``'s ``LossScale``, saved with every checkpoint (set by the run)."""
        joined = context.mesh
        # PipeDream's hybrid: this replica's piece of every held-out microbatch (as of every training one)
        self.piece = (joined.dp_rank, joined.data_parallel) if joined is not None and joined.outside else (0, 1)

    def reached(self, end: int, carry: StreamCarry | None = None) -> None:
        """``end`` steps of this run are done and nothing is in flight; ``carry``: a stream's policy state."""
        config, done = self.plan.config, self.plan.steps_done
        last = end == config.training.steps
        if config.data.eval_every is not None and (last or end % config.data.eval_every == 0):
            loss = self._evaluate()
            self.eval_losses.append((done + end, loss))
            if self.context.reporting:
                self.context.progress({"eval": len(self.eval_losses) - 1, "loss": loss})
        if config.checkpoint.save is not None and (
            last or end % (config.checkpoint.save_every or config.training.steps) == 0
        ):
            failure = checkpoint.save(
                config,
                self.plan.parts,
                self.schedule.placement,
                self.workers,
                done + end,
                carry=carry,
                run=self.plan.run_id,
                loss_scale=None if self.loss_scale is None else self.loss_scale.state_dict(),
            )
            if failure is not None:
                self.save_failures.append(failure)
                if last:
                    self.final_save_failure = failure
                elif len(self.save_failures) == 1 and self.rank == 0 and self.context.reporting:
                    self.context.progress({"checkpoint_failed": failure})  # said once, by stage rank 0's first process

    def _evaluate(self) -> float:
        """This rank's share of the mean loss over the held-out batches, through the forward-only schedule."""
        if self._evaluator is None:
            evaluation = forward_only(self.schedule)
            sizes = (
                self.plan.microbatch_sizes
                if self.piece[1] == 1
                else replica_microbatch_sizes(self.plan.config, self.piece[0])
            )
            self._evaluator = Executor(
                lower(evaluation),
                self.rank,
                self.workers,
                sizes[: evaluation.num_microbatches],
                self.device,
                evaluate=True,
                context=self.context,
            )
        evaluator, batches = self._evaluator, self.plan.config.data.eval_batches
        t = evaluator.lowered.schedule.num_microbatches
        total = sum(
            evaluator.run_step(
                *rank_microbatches(self.source, k, t, self.device, self.workers, held_out=True, piece=self.piece)
            )[0]
            for k in range(batches)
        )
        return total / batches


def rank_microbatches(
    source: Any,
    k: int,
    t: int,
    device: torch.device,
    workers: dict[int, StageWorker],
    *,
    held_out: bool = False,
    piece: tuple[int, int] = (0, 1),
) -> tuple[list[boundary.Boundary], list[boundary.Boundary]]:
    """Batch ``k``'s inputs and targets (held-out batch ``k``), each split into ``t`` microbatches on ``device``
    (``piece=(p, P)``: data-parallel replica p's piece of each, ``stream.replica_pieces``).

    Only a rank with a first or a last stage draws the batch (the inputs go to
    the first stage, the targets to the last, as DeepSpeed's pipeline engine
    loads them); a rank with neither gets empty lists and loads nothing.
    """
    if not any(w.is_first or w.is_last for w in workers.values()):
        return [], []
    if held_out or piece[1] > 1:  # variable lengths (step_microbatches) are a single pipeline's training
        inputs, targets = source.eval_batch(k) if held_out else source.batch(k)
        xs, ys = replica_pieces(inputs, t, piece), replica_pieces(targets, t, piece)
    else:
        xs, ys = step_microbatches(source, k, t)
    return [boundary.to(m, device) for m in xs], [boundary.to(m, device) for m in ys]
