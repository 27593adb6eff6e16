"""The IR's building blocks: actions, placements, schedules and their derived lookups."""

from __future__ import annotations

import pytest

from pipeweave.schedule import Action, Op, Placement, Schedule, ScheduleError, generate, parse_action
from pipeweave.schedule.ir import append_updates, check_positive


def test_action_text_form_is_stage_op_microbatch() -> None:
    assert str(Action(2, Op.F, 0)) == "2F0"
    assert str(Action(12, Op.W, 103)) == "12W103"
    assert str(Action(0, Op.SEND_F, 3)) == "0SEND_F3"
    for text in ("2F0", "1I3", "0W3", "2U0", "1B12", "3RECV_B7"):
        assert str(parse_action(text)) == text


@pytest.mark.parametrize("d", [1, 2, 3, 5, 8])
def test_straight_placement(d: int) -> None:
    p = Placement.straight(d)
    assert p.num_stages == p.num_parts == p.num_ranks == d
    assert [p.next_stage(s) for s in range(d)] == list(range(1, d)) + [None]
    assert [p.prev_stage(s) for s in range(d)] == [None] + list(range(d - 1))
    assert all(p.stages_on(r) == (r,) for r in range(d))


@pytest.mark.parametrize("d,v", [(1, 2), (2, 2), (3, 3), (4, 2)])
def test_looped_placement_puts_part_k_on_rank_k_mod_d(d: int, v: int) -> None:
    p = Placement.looped(d, v)
    assert p.num_stages == d * v and p.num_ranks == d
    assert all(p.stage_rank[k] == k % d for k in range(d * v))
    assert all(p.stages_on(r) == tuple(range(r, d * v, d)) for r in range(d))


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_vshape_goes_down_then_back_up(d: int) -> None:
    p = Placement.vshape(d)
    ranks = list(p.stage_rank)
    assert ranks == list(range(d)) + list(reversed(range(d)))
    assert p.stages_on(0) == (0, 2 * d - 1)  # rank 0 holds the first and the last part


@pytest.mark.parametrize("d", [2, 4, 6])
def test_bidirectional_has_two_replicas_per_part(d: int) -> None:
    p = Placement.bidirectional(d)
    assert p.num_parts == d and p.num_stages == 2 * d and len(p.pipelines) == 2
    for s in range(2 * d):
        reps = p.replicas(s)
        assert len(reps) == 2 and s in reps
        assert p.stage_rank[reps[0]] == d - 1 - p.stage_rank[reps[1]]
    assert p.next_stage(d - 1) is None and p.next_stage(2 * d - 1) is None
    assert p.pipeline_of(0) == 0 and p.pipeline_of(d) == 1


def test_placement_rejects_mismatched_stages_and_repeated_pipelines() -> None:
    with pytest.raises(ScheduleError, match="stage ranks"):
        Placement((0, 1), (0,), ((0,),))
    with pytest.raises(ScheduleError, match="visits parts"):
        Placement((0, 1), (1, 0), ((0, 1),))
    with pytest.raises(ScheduleError, match="two pipelines"):
        Placement((0, 1), (0, 1), ((0, 1), (0, 1)))


def test_shared_stage_has_its_neighbours_per_pipeline() -> None:
    """PipeDream's replicated part 0 on two ranks, part 1 on one: stage 2 lies on both pipelines."""
    p = Placement((0, 1, 2), (0, 0, 1), ((0, 2), (1, 2)))
    assert p.shared and not Placement.straight(3).shared
    assert p.neighbours() == ([-1, -1, -2], [2, 2, -1])  # -2: ask per microbatch
    assert p.next_stage(0) == p.next_stage(1) == 2 and p.next_stage(2) is None
    assert (p.prev_stage(2, 0), p.prev_stage(2, 1)) == (0, 1)
    with pytest.raises(ScheduleError, match="per microbatch"):
        p.prev_stage(2)
    s = Schedule("x", p, 4, ((), (), ()), microbatch_pipeline=(0, 1, 0, 1))
    assert s.microbatches_of(2) == [0, 1, 2, 3] and s.microbatches_of(1) == [1, 3]
    assert [s.prev_of(2, j) for j in range(4)] == [0, 1, 0, 1] and s.next_of(1, 3) == 2


def test_schedule_properties_and_routes() -> None:
    s = generate("1f1b", num_stages=3, num_microbatches=5)
    assert (s.num_ranks, s.num_stages, s.num_parts, s.num_chunks) == (3, 3, 3, 1)
    assert s.is_synchronous and s.num_steps == 1
    assert s.route(4) == (0, 1, 2)
    assert s.microbatches_of(1) == [0, 1, 2, 3, 4]
    triples = list(s.iter_actions())
    assert len(triples) == sum(len(row) for row in s.actions) == 3 * (2 * 5 + 1)
    assert all(s.actions[r][k] == a for r, k, a in triples)


def test_schedule_checks_microbatch_pipeline_length() -> None:
    with pytest.raises(ScheduleError, match="one pipeline per microbatch"):
        Schedule("x", Placement.straight(2), 3, ((), ()), microbatch_pipeline=(0, 0))


def test_with_actions_copies_everything_but_the_lists() -> None:
    s = generate("gpipe", num_stages=2, num_microbatches=2)
    rows = [list(reversed(row)) for row in s.actions]
    t = s.with_actions(rows)
    assert t.actions == tuple(tuple(r) for r in rows)
    assert (t.name, t.placement, t.num_microbatches, t.policy) == (s.name, s.placement, s.num_microbatches, s.policy)
    assert s.actions != t.actions  # the original is untouched


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_check_positive_rejects_non_positive_integers(value: object) -> None:
    with pytest.raises(ScheduleError, match="num_stages"):
        check_positive("num_stages", value)  # type: ignore[arg-type]


def test_append_updates_adds_one_u_per_stage_on_its_rank() -> None:
    p = Placement.looped(2, 2)
    rows: list[list[Action]] = [[], []]
    append_updates(rows, p)
    assert rows == [[Action(0, Op.U, 0), Action(2, Op.U, 0)], [Action(1, Op.U, 0), Action(3, Op.U, 0)]]
