"""The validator accepts every generated schedule and rejects mutated ones with the rank, step and a marked grid."""

from __future__ import annotations

import random

import pytest

from pipeweave.schedule import (
    SCHEDULES,
    Action,
    InvalidSchedule,
    Op,
    Schedule,
    ScheduleError,
    generate,
    is_valid,
    parse_actions,
    validate,
)

SIZES = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8)]
_FAST = [n for n in SCHEDULES if not n.endswith("-auto")]  # searched ones: a couple of sizes only


def _generated(names: list[str], sizes: list[tuple[int, int]]) -> list[Schedule]:
    out = []
    for name in names:
        for d, t in sizes:
            try:
                out.append(generate(name, num_stages=d, num_microbatches=t))
            except ScheduleError:
                continue  # a configuration this family does not serve
    return out


ALL = _generated(_FAST, SIZES) + _generated([n for n in SCHEDULES if n.endswith("-auto")], [(2, 4), (4, 8)])


def _id(s: Schedule) -> str:
    return f"{s.name}-D{s.num_ranks}-T{s.num_microbatches}"


def _rows(s: Schedule) -> list[list[Action]]:
    return [list(row) for row in s.actions]


def _fails(s: Schedule) -> InvalidSchedule:
    with pytest.raises(InvalidSchedule) as info:
        validate(s)
    return info.value


def test_every_family_is_covered() -> None:
    assert {s.name for s in ALL} == set(SCHEDULES)  # each serves at least one of the sizes


@pytest.mark.parametrize("schedule", ALL, ids=_id)
def test_generated_schedules_are_valid(schedule: Schedule) -> None:
    validate(schedule)


@pytest.mark.parametrize("schedule", [s for s in ALL if s.num_microbatches > 1], ids=_id)
def test_removing_any_compute_action_is_caught(schedule: Schedule) -> None:
    rng = random.Random(_id(schedule))
    rows = _rows(schedule)
    candidates = [(r, k) for r, row in enumerate(rows) for k, a in enumerate(row) if a.op is not Op.U]
    r, k = rng.choice(candidates)
    removed = rows[r].pop(k)
    exc = _fails(schedule.with_actions(rows))
    assert str(removed) in str(exc) or f"{removed.stage}" in exc.reason, exc.reason
    assert exc.rank == r or "deadlock" in exc.reason or "waits" in exc.reason


@pytest.mark.parametrize("schedule", ALL, ids=_id)
def test_backward_swapped_before_its_forward_is_caught(schedule: Schedule) -> None:
    rows = _rows(schedule)
    r, k_b, b = next((r, k, a) for r, row in enumerate(rows) for k, a in enumerate(row) if a.op in (Op.B, Op.I))
    k_f = rows[r].index(Action(b.stage, Op.F, b.microbatch))
    rows[r][k_f], rows[r][k_b] = rows[r][k_b], rows[r][k_f]
    mutated = schedule.with_actions(rows)
    exc = _fails(mutated)
    assert exc.rank >= 0 and exc.step >= 0
    assert f"[{mutated.actions[exc.rank][exc.step]}]" in str(exc)  # the grid marks the failing step
    if exc.rank == r:  # caught where it happened: the backward waits for its own later forward
        assert f"{b} needs {b.stage}F{b.microbatch}, which rank {r} only runs later" in exc.reason


# 1F1B on 3 ranks, 3 microbatches, as rows of text: the mutations below edit it.
BASE = [
    "0F0 0F1 0F2 0B0 0B1 0B2 0U0",
    "1F0 1F1 1B0 1F2 1B1 1B2 1U0",
    "2F0 2B0 2F1 2B1 2F2 2B2 2U0",
]


def _schedule(rows: list[str]) -> Schedule:
    return generate("1f1b", num_stages=3, num_microbatches=3).with_actions([parse_actions(r) for r in rows])


def test_base_is_valid() -> None:
    assert is_valid(_schedule(BASE))


def test_removed_backward_names_the_stage_and_microbatch() -> None:
    rows = [BASE[0], BASE[1].replace("1B1 ", ""), BASE[2]]
    exc = _fails(_schedule(rows))
    assert exc.rank == 1
    assert "1B1 (or 1I1 + 1W1) is missing" in exc.reason


def test_backward_before_forward_on_one_rank_names_rank_step_and_producer() -> None:
    rows = [BASE[0], BASE[1], "2B0 2F0 2F1 2B1 2F2 2B2 2U0"]
    exc = _fails(_schedule(rows))
    assert (exc.rank, exc.step) == (2, 0)
    assert "2B0 needs 2F0, which rank 2 only runs later, at step 1" in exc.reason
    assert "[2B0]" in str(exc)  # the marked grid
    assert "rank 0 |" in str(exc) and "rank 2 |" in str(exc)


def test_action_on_the_wrong_rank() -> None:
    rows = ["0F0 1F0 0F1 0F2 0B0 0B1 0B2 0U0", BASE[1].replace("1F0 ", ""), BASE[2]]
    exc = _fails(_schedule(rows))
    assert (exc.rank, exc.step) == (0, 1)
    assert "1F0 runs on rank 0, but stage 1 is placed on rank 1" in exc.reason
    assert "[1F0]" in str(exc)


def test_duplicate_action() -> None:
    rows = [BASE[0], BASE[1], "2F0 2B0 2F1 2B1 2F2 2B2 2F2 2U0"]
    exc = _fails(_schedule(rows))
    assert (exc.rank, exc.step) == (2, 6)
    assert "2F2 appears twice (first at rank 2 step 4)" in exc.reason


def test_deadlock_across_ranks_names_every_waiting_rank() -> None:
    # Rank 1 starts with microbatch 1, whose forward rank 0 runs only after
    # the backward of microbatch 0, which needs rank 1: a cycle.
    rows = [
        "0F0 0B0 0F1 0B1 0F2 0B2 0U0",
        "1F1 1F0 1B0 1B1 1F2 1B2 1U0",
        BASE[2],
    ]
    exc = _fails(_schedule(rows))
    assert "deadlock" in exc.reason
    assert "rank 0 step 1 (0B0) waits for 1B0" in exc.reason
    assert "rank 1 step 0 (1F1) waits for 0F1" in exc.reason
    assert (exc.rank, exc.step) == (0, 1) and "[0B0]" in str(exc)


def test_input_gradient_without_weight_gradient() -> None:
    s = generate("zb-h1", num_stages=2, num_microbatches=2)
    rows = _rows(s)
    rows[1].remove(Action(1, Op.W, 1))
    exc = _fails(s.with_actions(rows))
    assert "1W1 is missing" in exc.reason and exc.rank == 1


def test_update_before_the_work_it_applies() -> None:
    rows = [BASE[0], "1U0 1F0 1F1 1B0 1F2 1B1 1B2", BASE[2]]
    exc = _fails(_schedule(rows))
    assert exc.rank == 1 and exc.step == 0
    assert "weight gradient" in exc.reason


def test_message_is_one_line_plus_the_grid() -> None:
    rows = [BASE[0], BASE[1], "2B0 2F0 2F1 2B1 2F2 2B2 2U0"]
    lines = str(_fails(_schedule(rows))).splitlines()
    assert lines[0].startswith("invalid schedule '1f1b': rank 2 step 0:")
    assert [line.split("|")[0].strip() for line in lines[1:]] == ["rank 0", "rank 1", "rank 2"]


@pytest.mark.parametrize("schedule", ALL, ids=_id)
def test_lowering_pairs_every_send_with_its_receive(schedule: Schedule) -> None:
    from pipeweave.schedule.lower import lower
    from pipeweave.schedule.validate import check_lowering

    check_lowering(schedule)
    lowered = lower(schedule)
    compute = [[a for a in row if a.op in (Op.F, Op.B, Op.I, Op.W, Op.U)] for row in lowered.actions]
    assert compute == [list(row) for row in schedule.actions]  # lowering only inserts communication
    sends = sum(a.op in (Op.SEND_F, Op.SEND_B) for row in lowered.actions for a in row)
    recvs = sum(a.op in (Op.RECV_F, Op.RECV_B) for row in lowered.actions for a in row)
    placement = schedule.placement
    crossings = sum(  # one activation and one gradient message per cross-rank hop of each microbatch
        2
        for j in range(schedule.num_microbatches)
        for a, b in zip(schedule.route(j), schedule.route(j)[1:])
        if placement.stage_rank[a] != placement.stage_rank[b]
    )
    assert sends == recvs == crossings
