"""Hybrid data x pipeline parallelism: P replicas of a synchronous pipeline schedule, ranks as a grid.

Replica p of a D-rank schedule runs on ranks ``p*D .. p*D + D-1`` (rank
``p*D + r`` plays rank r of the base schedule), so a pipeline's stages are
neighbours and the gradient exchange crosses replicas. Replica p takes
microbatches ``p*T .. p*T + T-1`` of the ``P*T`` microbatches of a step
(its contiguous slice of the global batch). Its stages are the base stages
offset by ``p*S``; every part therefore has P stages (``Placement.replicas``),
and the gradients of a part's replicas are summed before its ``U`` -- the same
rule as Chimera's replicated parts, so the validator, the simulator and both
executors run the result unchanged. Each microbatch's loss is scaled by its
share of the global batch, so the sum is the global batch's gradient.
"""

from __future__ import annotations

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, ScheduleError, check_positive


def data_parallel(schedule: Schedule, num_replicas: int) -> Schedule:
    """``num_replicas`` copies of ``schedule`` side by side, their parts' gradients combined.

    Args:
        schedule: a synchronous schedule (one step ending in ``U``).
        num_replicas: P, pipeline replicas (data-parallel degree).

    Raises:
        ScheduleError: P < 1, or an asynchronous schedule.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = data_parallel(generate("1f1b", num_stages=2, num_microbatches=2), 2)
        >>> s.placement.stage_rank, s.placement.replicas(1)
        ((0, 1, 2, 3), (1, 3))
        >>> [str(a) for a in s.actions[3]]
        ['3F2', '3B2', '3F3', '3B3', '3U0']
    """
    check_positive("num_replicas", num_replicas, "give --data-parallel >= 1")
    if not schedule.is_synchronous:
        raise ScheduleError(
            f"schedule {schedule.name!r} is asynchronous; data-parallel replicas need a synchronous schedule"
        )
    if num_replicas == 1:
        return schedule
    base = schedule.placement
    ranks, stages, mbs = schedule.num_ranks, base.num_stages, schedule.num_microbatches
    placement = Placement(
        stage_rank=tuple(p * ranks + r for p in range(num_replicas) for r in base.stage_rank),
        stage_part=base.stage_part * num_replicas,
        pipelines=tuple(tuple(p * stages + s for s in line) for p in range(num_replicas) for line in base.pipelines),
    )
    lines = len(base.pipelines)
    route = tuple(p * lines + schedule.pipeline_of_microbatch(j) for p in range(num_replicas) for j in range(mbs))

    def shift(a: Action, p: int) -> Action:
        # U's microbatch field counts updates: it is the same in every replica.
        return Action(a.stage + p * stages, a.op, a.microbatch if a.op is Op.U else a.microbatch + p * mbs)

    actions = tuple(tuple(shift(a, p) for a in row) for p in range(num_replicas) for row in schedule.actions)
    return Schedule(
        name=schedule.name,
        placement=placement,
        num_microbatches=num_replicas * mbs,
        actions=actions,
        microbatch_pipeline=route,
        policy=schedule.policy,
        num_steps=schedule.num_steps,
        pairs=tuple((shift(f, p), shift(b, p)) for p in range(num_replicas) for f, b in schedule.pairs),
    )
