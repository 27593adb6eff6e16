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

Example:
    >>> from pipeweave.schedule import generate
    >>> [str(a) for a in forward_only(generate("1f1b", num_stages=2, num_microbatches=3)).actions[0]]
    ['0F0', '0F1', '0F2']
"""

from __future__ import annotations

from pipeweave.schedule.ir import Op, Schedule, ScheduleError


def forward_only(schedule: Schedule) -> Schedule:
    """Each rank's ``F`` actions of ``schedule``, in its order (raises ScheduleError for asynchronous ones)."""
    if not schedule.is_synchronous:
        raise ScheduleError(f"{schedule.name} is asynchronous: evaluation runs on synchronous schedules; "
                            "use a synchronous one")
    return schedule.with_actions([[a for a in row if a.op is Op.F] for row in schedule.actions])
