"""The forward-only schedule of a synchronous schedule, for evaluation.

Evaluating a model cut into stages is a pipeline of forwards alone: each
microbatch goes through the stages of its route and the last stage computes
its loss; nothing is kept for a backward and nothing is updated. The schedule
of that pipeline is each rank's ``F`` actions in the order its training
schedule runs them, on the same placement: F(s, j) depends only on F(s-1, j),
which precedes it in any valid training order, so the subsequence is deadlock
free whenever the training schedule is (``validate.check_order`` walks it,
tested for every synchronous schedule of the registry), and the runtime
evaluates on the very stages, placement and messages it trains with.

An asynchronous stream has no step to take the forwards of; its evaluation
pipeline is the forwards of its first mini-batch (T microbatches through
pipeline 0: AvgPipe's first replica), in the stream's order, as a synchronous
schedule of one step.

Example:
    >>> from pipeweave.schedule import generate
    >>> [str(a) for a in forward_only(generate("1f1b", num_stages=2, num_microbatches=3)).actions[0]]
    ['0F0', '0F1', '0F2']
"""

from __future__ import annotations

from pipeweave.schedule.ir import Op, Schedule, WeightPolicy
from pipeweave.schedule.round_robin import minibatch_pipelines


def forward_only(schedule: Schedule) -> Schedule:
    """Each rank's ``F`` actions of ``schedule``, in its order; of a stream, those of its first mini-batch.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = forward_only(generate("pipedream", num_stages=2, num_microbatches=2, num_steps=3))
        >>> [str(a) for a in s.actions[1]], s.num_microbatches, s.is_synchronous
        (['1F0', '1F1'], 2, True)
    """
    if schedule.is_synchronous:
        return schedule.with_actions([[a for a in row if a.op is Op.F] for row in schedule.actions])
    t = schedule.num_microbatches // (max(1, schedule.num_steps) * minibatch_pipelines(schedule))
    return Schedule(
        schedule.name,
        schedule.placement,
        t,
        tuple(tuple(a for a in row if a.op is Op.F and a.microbatch < t) for row in schedule.actions),
        microbatch_pipeline=schedule.microbatch_pipeline[:t],
        policy=WeightPolicy.SYNC,
    )
