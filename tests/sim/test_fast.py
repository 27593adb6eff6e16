"""The fast simulators (``sim.rounds`` and ``sim.compiled`` over ``sim.arrays``) against the pure-Python
reference, bit for bit.

Every registered schedule, at several sizes, under uniform costs and under
per-part costs that are not binary fractions (so that a different order of
float additions would show), with communication, dispatch gaps, updates and
data-parallel reductions (``update_delay``, issue 18): the same start and end
of every action and the same metrics.
"""

from __future__ import annotations

import copy
import math
import pickle
import random
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from pipeweave.schedule import SCHEDULES, ScheduleError, generate
from pipeweave.schedule.dataflow import execute
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.schedule.validate import InvalidSchedule
from pipeweave.sim import CostModel, compute_metrics, rounds, simulate
from pipeweave.sim.arrays import encode, schedule_arrays
from pipeweave.sim.compiled import walk_times
from pipeweave.sim.network import Link, Network
from pipeweave.sim.parallel import Layout, simulate_layout
from pipeweave.sim.recompute import RECOMPUTE
from pipeweave.sim.rounds import fast_times
from pipeweave.sim.timeline import action_time, simulate_parts
from pipeweave.sim.traffic import ModelBytes

SIZES = ((2, 2), (3, 5), (4, 8), (5, 7), (8, 12))


def schedules() -> list[Schedule]:
    out = []
    for name in SCHEDULES:
        for d, t in SIZES:
            if name.endswith("-auto") and d > 4:
                continue  # a search; its schedules are ordinary action lists like the rest
            try:
                out.append(generate(name, num_stages=d, num_microbatches=t))
            except ScheduleError:
                pass  # a size the family rejects (odd D for Chimera, ...)
    return out


def costs_for(schedule: Schedule, seed: int) -> CostModel:
    """Uniform costs (seed 0) or per-part ones with three decimals, comm, dispatch and U; seed 2 recomputes
    some parts (a backward's replay on top of the peak)."""
    if seed == 0:
        return CostModel()
    rng = random.Random(seed)
    n = schedule.num_parts

    def values() -> list[float]:
        return [round(rng.uniform(0.3, 3.0), 3) for _ in range(n)]

    cost = CostModel(
        f=values(),
        b=values(),
        w=values(),
        u=values(),
        comm=0.137 * seed,
        dispatch=0.011 * seed,
        activation=values(),
        mem_w=0.3,
        weight=values(),
    )
    if seed != 2:
        return cost
    return replace(
        cost,
        recompute=[rng.choice(RECOMPUTE) for _ in range(n)],
        replay_selective=values(),
        kept_selective=0.45,
        kept_full=0.1,
    )


ENGINES = {"rounds": math.inf, "compiled": 0}  # ``sim.rounds.COMPILED_FROM`` that makes "auto" take each


def same(fast: Callable[[], object], reference: object) -> None:
    """Under either fast engine (the rounds, the compiled walk): the same actions, starts and ends (floats
    compared exactly) and the same metrics as the reference."""
    first = None
    for threshold in ENGINES.values():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(rounds, "COMPILED_FROM", threshold)
            timeline = fast()
        times = timeline.times  # type: ignore[attr-defined]
        assert times is not None
        if first is None:
            assert timeline.events == reference.events  # type: ignore[attr-defined]
            assert compute_metrics(timeline) == compute_metrics(reference)  # type: ignore[arg-type]
            first = times
        else:  # the first engine's start and end, to the bit: so its events and metrics
            assert times.start.tobytes() == first.start.tobytes() and times.end.tobytes() == first.end.tobytes()


def rounds_ran(schedule: Schedule, costs: object, delay: list[float] | None = None) -> bool:
    """Both fast engines (the rounds, and their walk where they are too slow; the compiled walk), not the
    reference, timed it."""
    table = np.array(
        [
            [action_time(costs, p, op) for op in (Op.F, Op.B, Op.I, Op.W, Op.U)]  # type: ignore[arg-type]
            for p in schedule.placement.stage_part
        ]
    )
    comm = costs.comm  # type: ignore[attr-defined]
    return all(
        fast_times(
            schedule,
            schedule_arrays(schedule),
            table,
            latency=(lambda a, b: comm) if comm else None,
            gap=costs.dispatch,
            update_delay=delay,
            engine=engine,
        )
        is not None  # type: ignore[attr-defined]
        for engine in ENGINES
    )


@pytest.mark.parametrize("schedule", schedules(), ids=lambda s: f"{s.name}-D{s.num_ranks}-T{s.num_microbatches}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_simulation_is_the_reference_bit_for_bit(schedule: Schedule, seed: int) -> None:
    cost = costs_for(schedule, seed)
    same(lambda: simulate(schedule, cost), simulate(schedule, cost, fast=False))
    costs = cost.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    assert rounds_ran(schedule, costs)


@pytest.mark.parametrize("schedule", schedules(), ids=lambda s: f"{s.name}-D{s.num_ranks}-T{s.num_microbatches}")
def test_update_delay_is_the_reference_bit_for_bit(schedule: Schedule) -> None:
    costs = costs_for(schedule, 3).for_parts(num_parts=schedule.num_parts, num_ranks=schedule.num_ranks)
    delay = [round(0.7 + 0.913 * part, 3) for part in range(schedule.num_parts)]
    hop = lambda a, b: 0.05 * (a + 1) + 0.01 * b  # noqa: E731 - a latency per pair of stages
    same(
        lambda: simulate_parts(schedule, costs, hop=hop, update_delay=delay),
        simulate_parts(schedule, costs, hop=hop, update_delay=delay, fast=False),
    )
    if schedule.is_synchronous:  # a part on two ranks: the fast engine walks in the reference's order
        assert rounds_ran(schedule, costs, delay)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "chimera", "interleaved-1f1b", "pipedream"])
def test_a_layout_with_tp_and_dp_is_the_reference_bit_for_bit(name: str) -> None:
    schedule = generate(name, num_stages=4, num_microbatches=8)
    net = Network(
        intra_node=Link(bandwidth=3e3, latency=0.013), inter_node=Link(bandwidth=7e2, latency=0.11), gpus_per_node=4
    )
    layout = Layout(tp=2, dp=3, zero=1, network=net)
    model = ModelBytes(message=1e3, tp_collectives=2, params=5e4)
    cost = costs_for(schedule, 1)
    same(
        lambda: simulate_layout(schedule, cost, layout, model),
        simulate_layout(schedule, cost, layout, model, fast=False),
    )


@pytest.mark.parametrize("schedule", schedules(), ids=lambda s: f"{s.name}-D{s.num_ranks}-T{s.num_microbatches}")
def test_the_walk_after_the_rounds_is_the_reference_bit_for_bit(schedule: Schedule) -> None:
    costs = costs_for(schedule, 2).for_parts(num_parts=schedule.num_parts, num_ranks=schedule.num_ranks)
    table = np.array(
        [[action_time(costs, p, op) for op in (Op.F, Op.B, Op.I, Op.W, Op.U)] for p in schedule.placement.stage_part]
    )
    found = fast_times(
        schedule,
        schedule_arrays(schedule),
        table,
        latency=lambda a, b: 0.05 * a + 0.1,
        gap=costs.dispatch,
        update_delay=None,
        min_per_round=math.inf,
    )  # walk after 32 rounds
    assert found is not None
    reference = simulate_parts(schedule, costs, hop=lambda a, b: 0.05 * a + 0.1, fast=False)
    assert found[0].tolist() == [e.start for row in reference.events for e in row]
    assert found[1].tolist() == [e.end for row in reference.events for e in row]


def test_low_parallelism_walks_after_the_rounds_with_the_same_result() -> None:
    schedule = generate("naive", num_stages=16, num_microbatches=32)  # one action per round: walked
    cost = costs_for(schedule, 1)
    costs = cost.for_parts(num_parts=16, num_ranks=16)
    assert rounds_ran(schedule, costs)
    same(lambda: simulate(schedule, cost), simulate(schedule, cost, fast=False))


def _deadlocked() -> Schedule:
    good = generate("1f1b", num_stages=3, num_microbatches=4)
    rows = [list(row) for row in good.actions]
    rows[-1][0], rows[-1][1] = rows[-1][1], rows[-1][0]  # the last rank runs its first backward before its forward
    return good.with_actions(rows)


def _malformed() -> Schedule:
    good = generate("gpipe", num_stages=2, num_microbatches=2)
    rows = [list(row) for row in good.actions]
    rows[1].append(Action(1, Op.F, 0))  # a forward twice
    bad = good.with_actions(rows)
    assert not encode(bad).ok
    return bad


@pytest.mark.parametrize("make", [_deadlocked, _malformed])
def test_a_bad_schedule_is_explained_as_by_the_reference(make: Callable[[], Schedule]) -> None:
    bad = make()
    with pytest.raises(InvalidSchedule) as reference:
        simulate(bad, fast=False)
    for threshold in ENGINES.values():
        with pytest.MonkeyPatch.context() as patch, pytest.raises(InvalidSchedule) as fast:
            patch.setattr(rounds, "COMPILED_FROM", threshold)
            simulate(bad)
        assert str(fast.value) == str(reference.value)


def test_the_arrays_are_kept_per_schedule() -> None:
    schedule = generate("zb-h1", num_stages=3, num_microbatches=3)
    assert schedule_arrays(schedule) is schedule_arrays(schedule)
    assert schedule_arrays(schedule).op.tolist() == encode(schedule).op.tolist()


def test_a_fast_timeline_pickles_and_copies_with_its_times() -> None:
    timeline = simulate(generate("1f1b", num_stages=3, num_microbatches=4), CostModel(comm=0.25))
    for twin in (pickle.loads(pickle.dumps(timeline)), copy.deepcopy(timeline)):
        assert twin.times is not None and twin == timeline
    with pytest.raises(AttributeError):
        timeline.costs = None  # type: ignore[misc]


@pytest.mark.parametrize("name", ["chimera", "gems", "dualpipe", "dualpipe-v"])
def test_long_reductions_of_parts_on_two_ranks_queue_as_in_the_reference(name: str) -> None:
    # Reductions longer than a microbatch's work keep each rank's stream busy, so which rank
    # launches a part's reduction (the one the reference walks last to it) shows in the times.
    schedule = generate(name, num_stages=4, num_microbatches=8)
    costs = costs_for(schedule, 1).for_parts(num_parts=schedule.num_parts, num_ranks=4)
    delay = [5.0 + 3.1 * part for part in range(schedule.num_parts)]
    same(
        lambda: simulate_parts(schedule, costs, update_delay=delay),
        simulate_parts(schedule, costs, update_delay=delay, fast=False),
    )
    assert rounds_ran(schedule, costs, delay)


@pytest.mark.parametrize("name", [n for n in SCHEDULES if not n.endswith("-auto")])
def test_larger_schedules_past_the_rounds_trial_are_the_reference_bit_for_bit(name: str) -> None:
    # Beyond 256 rounds the engine judges its rate (and may walk on); four-decimal per-part costs.
    for d, t in ((16, 48), (32, 64)):
        try:
            schedule = generate(name, num_stages=d, num_microbatches=t)
        except ScheduleError:
            continue
        cost = costs_for(schedule, d)
        same(lambda: simulate(schedule, cost), simulate(schedule, cost, fast=False))
        costs = cost.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
        delay = [0.3 + 0.77 * part for part in range(schedule.num_parts)]
        same(
            lambda: simulate_parts(schedule, costs, update_delay=delay),
            simulate_parts(schedule, costs, update_delay=delay, fast=False),
        )


def test_a_deadlock_in_the_walk_leaves_the_schedule_to_the_reference() -> None:
    # Each rank's own order is fine, but rank 0's first backward waits on rank 1's, which comes after
    # rank 1's second forward, which waits on rank 0's, which comes after that backward: a cycle.
    # With min_per_round = inf the walk takes over from the first rounds, which cannot move either.
    good = generate("1f1b", num_stages=2, num_microbatches=2)
    f, b = (lambda s, j: Action(s, Op.F, j)), (lambda s, j: Action(s, Op.B, j))
    bad = good.with_actions(
        [
            [f(0, 0), b(0, 0), f(0, 1), b(0, 1), Action(0, Op.U, 0)],
            [f(1, 0), f(1, 1), b(1, 0), b(1, 1), Action(1, Op.U, 0)],
        ]
    )
    for engine in ENGINES:
        assert (
            fast_times(
                bad,
                schedule_arrays(bad),
                np.ones((bad.num_stages, 5)),
                latency=None,
                gap=0.0,
                update_delay=None,
                min_per_round=math.inf,
                engine=engine,
            )
            is None
        )
    with pytest.raises(InvalidSchedule):
        simulate(bad)


@pytest.mark.parametrize("name", ["chimera", "gems", "dualpipe", "dualpipe-v", "zb-v", "interleaved-1f1b"])
def test_the_walks_take_the_actions_in_the_reference_order(name: str) -> None:
    # Which rank reduces a part held on two ranks depends on the order the reference walks the actions;
    # both fast walks record it. The reference's duration callback sees each action when it times it.
    schedule = generate(name, num_stages=4, num_microbatches=8)
    seen: list[Action] = []
    execute(schedule, lambda a: seen.append(a) or 1.0 + 0.1 * a.stage)
    expected = [a for a in seen if a.op is not Op.U]
    actions = [a for row in schedule.actions for a in row]
    arrays = schedule_arrays(schedule)
    durations = np.array([[1.0 + 0.1 * s] * 5 for s in range(schedule.num_stages)])
    stops = rounds._loop_ends(arrays, schedule.is_synchronous)
    loop = rounds._Loop(schedule, arrays, stops, durations, None, 0.0)
    order: list[int] = []
    assert loop.ordered and loop.walk(order)
    slot_to_action = {int(slot): k for k, slot in enumerate(loop.slots(np.arange(arrays.size)))}
    assert [actions[slot_to_action[k]] for k in order] == expected
    prev, nxt = rounds._neighbours(schedule.placement)
    found = walk_times(
        arrays,
        stops,
        durations,
        neighbours=(prev, nxt),
        stage_rank=np.asarray(schedule.placement.stage_rank),
        hops=None,
        gap=0.0,
        extra=None,
        num_microbatches=schedule.num_microbatches,
    )
    assert found is not None
    walked = found[2]
    assert [
        actions[k] for k in np.argsort(np.where(walked < 0, len(walked), walked), kind="stable") if walked[k] >= 0
    ] == expected
