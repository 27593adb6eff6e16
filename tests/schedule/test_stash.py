"""Memory actions (schedule.levers): lowering, BPipe's shares, the validator."""

from __future__ import annotations

import pytest

from pipeweave.errors import UserError
from pipeweave.schedule import generate
from pipeweave.schedule.ir import Action, Op
from pipeweave.schedule.levers import Stash, StashPlan, check_stash, evicted_shares, parse_offload, partner, plan_stash
from pipeweave.schedule.validate import InvalidSchedule

NAMES = (("1f1b", {}), ("zb-h1", {}), ("interleaved-1f1b", {"num_chunks": 2}))


@pytest.mark.parametrize("name, options", NAMES)
@pytest.mark.parametrize("plan", [StashPlan(offload=frozenset({0, 2})), StashPlan(balance=True)])
def test_every_move_away_follows_its_forward_and_comes_back_right_before_its_backward(name, options, plan):
    s = generate(name, num_stages=4, num_microbatches=8, **options)
    stash = plan_stash(s, plan)
    check_stash(stash)
    for rank, row in enumerate(stash.actions):
        assert [a for a in row if a.op.is_compute] == list(s.actions[rank])
        for k, a in enumerate(row):
            if a.op in (Op.OFFLOAD, Op.EVICT):
                assert row[k - 1] == Action(a.stage, Op.F, a.microbatch)
            if a.op in (Op.RELOAD, Op.LOAD):
                assert row[k + 1].op.computes_input_grad and row[k + 1][::2] == a[::2]
    moved = {a for row in stash.actions for a in row if a.op.is_memory}
    if plan.offload:
        assert {a.stage for a in moved} == {s_ for s_ in range(s.num_stages) if s.placement.stage_part[s_] in (0, 2)}
        assert len(moved) == 2 * 8 * 2
    else:
        assert moved and all(stash.share[s.placement.stage_rank[a.stage]] > 0 for a in moved)


def test_bpipe_pairs_rank_r_with_d_minus_1_minus_r_and_evicts_down_to_the_pairs_mean():
    assert [partner(r, 4) for r in range(4)] == [3, 2, 1, 0]
    assert partner(1, 3) is None
    s = generate("1f1b", num_stages=4, num_microbatches=8)
    # 1F1B holds 4, 3, 2, 1 microbatches: pairs (0, 3) and (1, 2) have mean 2.5; rank 0 holds one
    # microbatch whole (the one just forwarded or about to be backwarded) and three others: 1 + 3 (1 - x) = 2.5.
    assert evicted_shares(s, StashPlan(balance=True), (1.0,) * 4, 0.5) == (0.5, 0.25, 0.0, 0.0)
    assert evicted_shares(
        generate("1f1b", num_stages=3, num_microbatches=6), StashPlan(balance=True), (1.0,) * 3, 0.5
    ) == (0.5, 0.0, 0.0)


def _moved(stash: Stash, rank: int, old: int, new: int) -> Stash:
    rows = [list(r) for r in stash.actions]
    rows[rank].insert(new, rows[rank].pop(old))
    return Stash(stash.schedule, stash.plan, tuple(map(tuple, rows)), stash.share)


def test_the_validator_names_a_reload_after_its_backward_and_an_offload_before_its_forward():
    s = generate("1f1b", num_stages=2, num_microbatches=2)
    stash = plan_stash(s, StashPlan(offload=frozenset({0})))
    row = stash.actions[0]  # 0F0 0OFFLOAD0 0F1 0OFFLOAD1 0RELOAD0 0B0 ...
    with pytest.raises(InvalidSchedule, match="0RELOAD0 must come before it"):
        check_stash(_moved(stash, 0, row.index(Action(0, Op.RELOAD, 0)), len(row) - 1))
    with pytest.raises(InvalidSchedule, match="comes before 0F1"):
        check_stash(_moved(stash, 0, row.index(Action(0, Op.OFFLOAD, 1)), 0))
    bpipe = plan_stash(generate("1f1b", num_stages=4, num_microbatches=8), StashPlan(balance=True))
    load = bpipe.actions[0].index(Action(0, Op.LOAD, 3))
    with pytest.raises(InvalidSchedule, match="0LOAD3 must come before it"):
        check_stash(_moved(bpipe, 0, load, load + 3))


def test_offload_parts_are_read_as_all_none_or_numbers_and_bad_ones_are_one_line():
    assert parse_offload("1, 3", 4) == frozenset({1, 3})
    assert parse_offload("none", 4) == frozenset()
    with pytest.raises(UserError, match="'4' is not a part; give all, none or part numbers 0..3"):
        parse_offload("4", 4)
    with pytest.raises(UserError, match="fp4 is not supported"):
        StashPlan(compress="fp4")
