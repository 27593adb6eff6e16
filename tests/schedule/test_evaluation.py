"""The forward-only schedule of every schedule walks and lowers (evaluation never deadlocks).

Also ``concatenate``: several drained streams as one run (what ``--eval-every``
makes of an asynchronous schedule) is a valid stream whose versions are each
segment's, shifted by the updates before it.
"""

from __future__ import annotations

import pytest

from pipeweave.schedule import SCHEDULES, ScheduleError, generate, lower
from pipeweave.schedule.evaluation import forward_only
from pipeweave.schedule.ir import Action, Op
from pipeweave.schedule.stream import concatenate
from pipeweave.schedule.validate import check_lowering, check_order, validate
from pipeweave.sim.versions import read_versions


def _schedules() -> list[tuple[str, int]]:
    return [(name, d) for name, info in SCHEDULES.items() if info.synchronous for d in (2, 3, 4)]


@pytest.mark.parametrize(("name", "stages"), _schedules())
def test_forward_only_walks_and_lowers(name: str, stages: int) -> None:
    info = SCHEDULES[name]
    try:
        schedule = generate(
            name, num_stages=stages, num_microbatches=2 * stages, num_chunks=2 if info.chunks is None else None
        )
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


ASYNC = [name for name, info in SCHEDULES.items() if not info.synchronous]


@pytest.mark.parametrize("name", ASYNC)
def test_forward_only_of_a_stream_is_its_first_minibatch_through_pipeline_0(name: str) -> None:
    schedule = generate(name, num_stages=3, num_microbatches=2, num_steps=4)
    evaluation = forward_only(schedule)
    assert evaluation.is_synchronous and evaluation.num_microbatches == 2
    for row, full in zip(evaluation.actions, schedule.actions):
        assert list(row) == [a for a in full if a.op is Op.F and a.microbatch < 2]
    assert {evaluation.route(j) for j in range(2)} == {schedule.placement.pipelines[0]}
    assert sum(len(row) for row in evaluation.actions) == 2 * len(schedule.placement.pipelines[0])
    check_order(evaluation)
    check_lowering(evaluation)


@pytest.mark.parametrize("name", ASYNC)
def test_concatenated_streams_are_a_stream_reading_each_segments_versions(name: str) -> None:
    segments = [generate(name, num_stages=3, num_microbatches=2, num_steps=n) for n in (1, 2)]
    run = concatenate(segments)
    validate(run)
    assert run.num_microbatches == sum(s.num_microbatches for s in segments)
    assert run.num_steps == 3
    expected: dict[Action, tuple[int, int]] = {}
    microbatches, updates = 0, 0
    for seg in segments:
        for a, v in read_versions(seg).items():
            expected[Action(a.stage, a.op, a.microbatch + microbatches)] = (v.version + updates, v.target + updates)
        microbatches += seg.num_microbatches
        updates += sum(1 for a in seg.actions[0] if a.op is Op.U and a.stage == 0)
    assert {a: (v.version, v.target) for a, v in read_versions(run).items()} == expected
    lowered = lower(run)
    assert len(lowered.actions) == run.num_ranks


def test_concatenate_refuses_synchronous_or_mismatched_segments() -> None:
    with pytest.raises(ScheduleError, match="1f1b is synchronous"):
        concatenate([generate("1f1b", num_stages=2, num_microbatches=2)])
    with pytest.raises(ScheduleError, match="share a placement and a policy"):
        concatenate(
            [
                generate("pipedream", num_stages=2, num_microbatches=2),
                generate("pipemare", num_stages=2, num_microbatches=2),
            ]
        )
    with pytest.raises(ScheduleError, match="at least one"):
        concatenate([])
