"""Optimizer post-validation in the distributed runtime (Qi et al., ICLR 2024, section 4).

With ``TrainConfig.post_validation`` set, each stage's optimizer is replaced by
a ``ValidatedOptimizer`` (``validated_optimizer``, a build step of ``run.workers``).
At its ``U`` a stage:

1. receives the partial state (sum of squared gradient norms, non-finite
   flag) of the stages before it from the previous rank, adds its own, and
   sends it on to the next rank;
2. steps optimistically on what it has seen (``weights.post_validation``);
3. receives the complete state from the last stage, which sends it to every
   rank, and validates: keeps the step, rolls it back in place (a non-finite
   gradient anywhere: the step is skipped), or rolls back and steps again on
   gradients clipped to ``max_norm`` (torch.nn.utils.clip_grad_norm_'s factor).

No all-reduce and no barrier: the state travels down the pipeline with the
stages' own ``U`` order, and the only wait is for the complete state, before
the stage's next forward. The result equals synchronous clipping and skipping
to float rounding (tests/runtime/test_validation_step.py).

Its messages are ordered like the schedule's, by construction, so NCCL (which
ignores tags and pairs a pair's messages in posting order) pairs them as gloo
does: each is a tensor on the rank's device, posted as a group of its own
through the transport's ``post_group`` (on the same communicator as the
schedule's groups), at the stage's ``U``. In a synchronous step every rank
has posted all of the step's schedule messages before its ``U``
(``P2P.before_update`` closes the last group) and posts the next step's
after it, and each ordered pair of ranks carries one post-validation message
a step (the partial state down the pipeline, the total from the last rank),
so on both ends of every pair it sits between the same two steps' messages
(``tests/runtime/test_batched_p2p.py`` records both ends). Tags above the
transport's are kept: unique, which gloo matches on. Straight placements only
(one stage per rank, no replicas): 1F1B, ZB-H1/H2, zb-auto.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeweave.config.policy import PostValidation  # noqa: F401  (re-exported: made from --clip-grad-norm)
from pipeweave.errors import UserError
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.stage.build import Stage
from pipeweave.runtime.stage.tied import repeated_members
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.transport import p2p
from pipeweave.schedule.ir import Schedule
from pipeweave.weights.post_validation import SGD, AdamW, GradState, PostValidatedStep

# Far above the transport's tags ((stage x kinds + kind) x span + microbatch + 1).
_TAG_PARTIAL = 1 << 28
_TAG_TOTAL = _TAG_PARTIAL + 1


def check_post_validation(schedule: Schedule, device: torch.device | str = "cpu") -> None:
    """Raise UserError unless post-validation applies to ``schedule`` (on any device: its messages are NCCL-safe).

    Example:
        >>> from pipeweave.schedule import generate
        >>> check_post_validation(generate("1f1b", num_stages=2, num_microbatches=2), "cuda")
        >>> check_post_validation(generate("interleaved-1f1b", num_stages=2, num_microbatches=2, num_chunks=2))
        Traceback (most recent call last):
        ...
        pipeweave.errors.UserError: post-validation needs one stage per rank and no replicas; interleaved-1f1b has 2 chunks and 1 pipelines; use a straight schedule such as zb-auto, zb-h2 or 1f1b
    """
    placement = schedule.placement
    if schedule.num_chunks != 1 or len(placement.pipelines) != 1 or placement.num_parts != schedule.num_ranks:
        raise UserError(
            f"post-validation needs one stage per rank and no replicas; {schedule.name} has "
            f"{schedule.num_chunks} chunks and {len(placement.pipelines)} pipelines; "
            "use a straight schedule such as zb-auto, zb-h2 or 1f1b"
        )


class ValidatedOptimizer:
    """Stands in for one stage's torch optimizer: ``step`` is the post-validated step.

    Built by ``validated_optimizer``; ``outcomes`` lists each step's
    ("kept", "clipped" or "skipped"). Example, on every rank of a run::

        config = TrainConfig(schedule="zb-auto", num_stages=4, post_validation=PostValidation(max_norm=1.0))
        launch(run_rank, config, 4)
    """

    def __init__(
        self,
        worker: StageWorker | Stage,
        stage: int,
        schedule: Schedule,
        options: PostValidation,
        inner: SGD | AdamW,
        context: RankContext | None = None,
    ) -> None:
        self.context = context if context is not None else RankContext()
        placement = schedule.placement
        self.params = list(worker.module.parameters())
        repeated = repeated_members(worker)  # a tied group counts once in the norm, as in plain training
        self.counted = [p for p in self.params if id(p) not in repeated]
        self.stage, self.options = stage, options
        prev, nxt = placement.prev_stage(stage), placement.next_stage(stage)
        self.prev_rank = None if prev is None else placement.stage_rank[prev]
        self.next_rank = None if nxt is None else placement.stage_rank[nxt]
        self.last_rank = placement.stage_rank[placement.pipelines[0][-1]]
        self.other_ranks = [r for r in range(schedule.num_ranks) if r != self.last_rank]
        self.step_state = PostValidatedStep(self.params, inner, options.max_norm)
        self.outcomes: list[str] = []
        self.norms: list[float] = []
        """Per step, the global gradient norm (``nan`` or ``inf`` where a gradient was not finite)."""
        self._sends: list[Any] = []

    def step(self, skip: bool = False) -> None:
        """The post-validated step; ``skip``: the step is known to be skipped (a non-finite loss), nothing moves."""
        self._wait_sends()
        if self.options.fault == (len(self.outcomes), self.stage):
            grad = next(p.grad for p in self.params if p.grad is not None)
            grad.view(-1)[0] = float("nan")
        partial = GradState.of(self.counted)
        if skip:  # said before any stage steps optimistically: no rollback, the weights stay bitwise
            partial = GradState(partial.sq_norm, True)
        if self.prev_rank is not None:
            partial = _recv(self.context, self.prev_rank, _TAG_PARTIAL).combine(partial)
        if self.next_rank is not None:
            self._sends.append(_isend(self.context, partial, self.next_rank, _TAG_PARTIAL))
        self.step_state.step_optimistic(partial)
        if self.next_rank is None:  # the last stage knows the total: every other rank needs it
            total = partial
            self._sends += [_isend(self.context, total, r, _TAG_TOTAL) for r in self.other_ranks]
        else:
            total = _recv(self.context, self.last_rank, _TAG_TOTAL)
        self.outcomes.append(self.step_state.validate(total))
        self.norms.append(total.norm)

    def skip_step(self) -> None:
        """A skipped step (``StageWorker.update(skip=True)``): the state still goes down the pipeline."""
        self.step(skip=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def _wait_sends(self) -> None:
        for work in self._sends:
            work.wait(self.context.timeout)
        self._sends.clear()


def validated_optimizer(
    options: PostValidation,
    schedule: Schedule,
    index: int,
    stage: Stage,
    optimizer: str,
    lr: float,
    momentum: float = 0.0,
    context: RankContext | None = None,
) -> ValidatedOptimizer:
    """Stage ``index``'s post-validated optimizer, in place of its torch one (a build step of the stage).

    Args:
        options: clipping and test faults.
        schedule: the run's schedule (checked by ``check_post_validation``).
        index, stage: the stage's number in ``schedule``, and the stage under construction.
        optimizer: "sgd" (torch.optim.SGD with ``momentum``) or "adamw" (torch.optim.AdamW's defaults).
        lr: learning rate.
        context: this rank's run context (the process of each stage rank, the wait timeout).

    Raises:
        UserError: a schedule it does not apply to, a CUDA device, or an unknown optimizer.
    """
    check_post_validation(schedule, context.device if context is not None else "cpu")
    inner: SGD | AdamW
    if optimizer == "sgd":
        inner = SGD(lr=lr, momentum=momentum)
    elif optimizer == "adamw":
        inner = AdamW(lr=lr)
    else:
        raise UserError(f"--optimizer {optimizer!r} has no post-validated step; use sgd or adamw")
    return ValidatedOptimizer(stage, index, schedule, options, inner, context)


def _isend(context: RankContext, state: GradState, dst: int, tag: int) -> Any:
    """Post ``state`` to stage rank ``dst`` as a group of its own (module docstring): its work."""
    message = torch.tensor([state.sq_norm, 1.0 if state.nonfinite else 0.0], dtype=torch.float64)
    (work, *_) = p2p.post_group([(True, message.to(context.device), context.process_of(dst), tag)])
    return work


def _recv(context: RankContext, src: int, tag: int) -> GradState:
    buffer = torch.zeros(2, dtype=torch.float64, device=context.device)
    (work, *_) = p2p.post_group([(False, buffer, context.process_of(src), tag)])
    work.wait(context.timeout)
    sq_norm, nonfinite = buffer.tolist()
    return GradState(float(sq_norm), nonfinite != 0)
