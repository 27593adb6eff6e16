"""The forward-only schedule of every synchronous schedule walks and lowers (evaluation never deadlocks)."""

from __future__ import annotations

import pytest

from pipeweave.schedule import SCHEDULES, ScheduleError, generate, lower
from pipeweave.schedule.evaluation import forward_only
from pipeweave.schedule.ir import Op
from pipeweave.schedule.validate import check_lowering, check_order


def _schedules() -> list[tuple[str, int]]:
    return [(name, d) for name, info in SCHEDULES.items() if info.synchronous for d in (2, 3, 4)]


@pytest.mark.parametrize(("name", "stages"), _schedules())
def test_forward_only_walks_and_lowers(name: str, stages: int) -> None:
    info = SCHEDULES[name]
    try:
        schedule = generate(name, num_stages=stages, num_microbatches=2 * stages,
                            num_chunks=2 if info.chunks is None else None)
    except ScheduleError:
        pytest.skip(f"{name} does not take D={stages}")
    evaluation = forward_only(schedule)
    for row, full in zip(evaluation.actions, schedule.actions):
        assert list(row) == [a for a in full if a.op is Op.F]
    assert sum(len(row) for row in evaluation.actions) == sum(len(schedule.route(j)) for j in range(2 * stages))
    check_order(evaluation)
    check_lowering(evaluation)
    lowered = lower(evaluation)
    assert {a.op for row in lowered.actions for a in row} <= {Op.F, Op.SEND_F, Op.RECV_F}


def test_asynchronous_schedules_have_no_evaluation_pass() -> None:
    with pytest.raises(ScheduleError, match="pipedream is asynchronous"):
        forward_only(generate("pipedream", num_stages=2, num_microbatches=4))
