"""The simulator against closed forms, hand-computed timelines and a brute-force reference."""

from __future__ import annotations

import random

import pytest

from pipeweave.errors import UserError
from pipeweave.schedule import SCHEDULES, Action, InvalidSchedule, Op, Schedule, ScheduleError, from_csv, generate
from pipeweave.sim import CostModel, compute_metrics, simulate
from pipeweave.sim.timeline import action_time

GRID = [(d, t) for d in range(1, 9) for t in range(1, 25)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_equal_their_closed_forms(name: str) -> None:
    for d, t in GRID:
        m = compute_metrics(simulate(generate(name, num_stages=d, num_microbatches=t)))
        ideal = (d - 1) / (t + d - 1)
        assert m.bubble_ratio == pytest.approx(ideal, abs=1e-12), (d, t)
        assert m.bubble_ratio_flush == pytest.approx(ideal, abs=1e-12), (d, t)
        assert m.bubble_overhead == pytest.approx((d - 1) / t, abs=1e-12), (d, t)
        assert m.makespan == 3 * (t + d - 1)  # f + b + w = 3 per microbatch and stage
        expected = [float(t)] * d if name == "gpipe" else [float(min(d - r, t)) for r in range(d)]
        assert list(m.peak_activations) == expected, (d, t)
        assert list(m.weight_versions) == [1.0] * d and list(m.staleness) == [0] * d


def test_naive_has_one_microbatch_in_flight() -> None:
    for d, t in GRID[::5]:
        m = compute_metrics(simulate(generate("naive", num_stages=d, num_microbatches=t)))
        assert m.bubble_ratio == pytest.approx((d - 1) / d, abs=1e-12)
        assert m.makespan == 3 * d * t
        assert list(m.peak_activations) == [1.0] * d


def _timeline(schedule: Schedule, cost: CostModel) -> list[list[tuple[str, float, float]]]:
    return [[(str(e.action), e.start, e.end) for e in row] for row in simulate(schedule, cost).events]


def test_gpipe_with_uneven_parts_matches_the_hand_timeline() -> None:
    # f = (1, 2, 1), b = (1, 1, 2), w = (0, 1, 0): B lasts (1, 2, 2).
    #   time    0   1   2   3   4   5   6   7   8   9  10  11  12  13
    #   rank 0 |F0 |F1 |                                   |B0 |B1 |
    #   rank 1 |   |F0     |F1     |       |B0     |B1     |
    #   rank 2 |           |F0 |   |F1 |B0     |B1     |
    cost = CostModel(f=[1, 2, 1], b=[1, 1, 2], w=[0, 1, 0])
    got = _timeline(generate("gpipe", num_stages=3, num_microbatches=2), cost)
    assert got == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 10, 11), ("0B1", 12, 13), ("0U0", 13, 13)],
        [("1F0", 1, 3), ("1F1", 3, 5), ("1B0", 8, 10), ("1B1", 10, 12), ("1U0", 12, 12)],
        [("2F0", 3, 4), ("2F1", 5, 6), ("2B0", 6, 8), ("2B1", 8, 10), ("2U0", 10, 10)],
    ]
    m = compute_metrics(simulate(generate("gpipe", num_stages=3, num_microbatches=2), cost))
    assert m.makespan == 13 and m.busy == (4, 8, 6) and m.span == (13, 11, 7)
    assert m.bubble_ratio == pytest.approx(1 - 18 / 39)


def test_1f1b_with_uneven_parts_matches_the_hand_timeline() -> None:
    # f = (1, 2), b = (1, 1), w = (1, 0): B lasts (2, 1).
    #   time    0   1   2   3   4   5   6   7   8   9  10  11  12
    #   rank 0 |F0 |F1 |       |B0     |F2 |B1     |   |B2     |
    #   rank 1 |   |F0     |B0 |F1     |B1 |F2     |B2 |
    cost = CostModel(f=[1, 2], b=[1, 1], w=[1, 0])
    got = _timeline(generate("1f1b", num_stages=2, num_microbatches=3), cost)
    assert got == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0F2", 6, 7), ("0B1", 7, 9), ("0B2", 10, 12), ("0U0", 12, 12)],
        [("1F0", 1, 3), ("1B0", 3, 4), ("1F1", 4, 6), ("1B1", 6, 7), ("1F2", 7, 9), ("1B2", 9, 10), ("1U0", 10, 10)],
    ]


def test_split_backward_times() -> None:
    # zb-h1 on one rank: F, I and W take f, b and w; W waits for its own I.
    cost = CostModel(f=2, b=3, w=5)
    got = _timeline(generate("zb-h1", num_stages=1, num_microbatches=1), cost)
    assert got == [[("0F0", 0, 2), ("0I0", 2, 5), ("0W0", 5, 10), ("0U0", 10, 10)]]


def test_update_takes_u_per_part_and_counts_as_busy() -> None:
    # zb-h1 on one rank with u = 4: U is charged after W; 1F1B on 2 ranks with uneven u: each
    # rank's U follows its last backward, so the makespan grows by rank 0's u (it ends last).
    got = _timeline(generate("zb-h1", num_stages=1, num_microbatches=1), CostModel(f=2, b=3, w=5, u=4))
    assert got[0][-1] == ("0U0", 10, 14)
    s = generate("1f1b", num_stages=2, num_microbatches=3)
    base = compute_metrics(simulate(s, CostModel()))
    uneven = compute_metrics(simulate(s, CostModel(u=[0.5, 0.25])))
    assert uneven.makespan == pytest.approx(base.makespan + 0.5)
    assert uneven.bubble_ratio_flush == pytest.approx(1 - (2 * 9 + 0.75) / (2 * (base.makespan + 0.5)))
    with pytest.raises(UserError, match="cost u=-1"):
        CostModel(u=-1)


@pytest.mark.parametrize("comm", [0.25, 1.0])
def test_comm_latency_adds_two_hops_per_boundary_to_gpipe(comm: float) -> None:
    # Forward crosses D-1 boundaries, backward D-1 back: 3(T+D-1) + 2(D-1)c.
    for d in range(1, 6):
        for t in range(1, 7):
            m = compute_metrics(simulate(generate("gpipe", num_stages=d, num_microbatches=t), CostModel(comm=comm)))
            assert m.makespan == pytest.approx(3 * (t + d - 1) + 2 * (d - 1) * comm), (d, t)


def test_comm_is_free_between_stages_on_one_rank() -> None:
    # Two parts on one rank (scalar costs are split evenly between them: f = 0.5 each).
    s = from_csv("0F0,1F0,1B0,0B0\n")
    assert compute_metrics(simulate(s, CostModel(comm=5.0))).makespan == 3.0


def test_costs_must_have_one_value_per_part() -> None:
    with pytest.raises(UserError, match="cost f has 2 values for 3 parts"):
        simulate(generate("1f1b", num_stages=3, num_microbatches=2), CostModel(f=[1, 2]))
    with pytest.raises(UserError, match="comm"):
        CostModel(comm=-1)


def test_a_deadlocked_schedule_is_not_simulated() -> None:
    s = from_csv("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    with pytest.raises(InvalidSchedule, match="deadlock"):
        simulate(s)


def _reference(schedule: Schedule, cost: CostModel) -> list[list[tuple[float, float]]]:
    """Start and end of every action by fixed-point relaxation, from the dependency rules directly."""
    costs = cost.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    p = schedule.placement
    where = {a: (r, k) for r, k, a in schedule.iter_actions()}
    grads: dict[int, list[Action]] = {}
    for _, _, a in schedule.iter_actions():
        if a.op in (Op.B, Op.W):
            grads.setdefault(p.stage_part[a.stage], []).append(a)

    def deps(a: Action) -> list[Action]:
        s, op, j = a
        if op is Op.F:
            prev = p.prev_stage(s)
            return [] if prev is None else [Action(prev, Op.F, j)]
        if op in (Op.B, Op.I):
            nxt = p.next_stage(s)
            out = [Action(s, Op.F, j)]
            if nxt is not None:
                out.append(Action(nxt, Op.B, j) if Action(nxt, Op.B, j) in where else Action(nxt, Op.I, j))
            return out
        if op is Op.W:
            return [Action(s, Op.I, j)]
        return list(grads.get(p.stage_part[s], [])) if schedule.is_synchronous else []

    times: list[list[tuple[float, float]]] = [[(0.0, 0.0)] * len(row) for row in schedule.actions]
    for _ in range(sum(len(row) for row in schedule.actions) + 1):
        changed = False
        for r, row in enumerate(schedule.actions):
            for k, a in enumerate(row):
                t0 = times[r][k - 1][1] if k else 0.0
                for d in deps(a):
                    hop = costs.comm if a.op is not Op.U and p.stage_rank[d.stage] != r else 0.0
                    t0 = max(t0, times[where[d][0]][where[d][1]][1] + hop)
                t1 = t0 + action_time(costs, p.stage_part[a.stage], a.op)
                if times[r][k] != (t0, t1):
                    times[r][k], changed = (t0, t1), True
        if not changed:
            return times
    raise AssertionError("no fixed point: the schedule deadlocks")


def _cases() -> list[Schedule]:
    out = []
    for name in SCHEDULES:
        if name.endswith("-auto"):
            continue
        for d, t in [(2, 4), (3, 3), (4, 8)]:
            try:
                out.append(generate(name, num_stages=d, num_microbatches=t))
            except ScheduleError:
                continue
    return out


@pytest.mark.parametrize("schedule", _cases(), ids=lambda s: f"{s.name}-D{s.num_ranks}-T{s.num_microbatches}")
def test_simulator_equals_brute_force_relaxation(schedule: Schedule) -> None:
    rng = random.Random(f"{schedule.name}{schedule.num_ranks}{schedule.num_microbatches}")
    n = schedule.num_parts
    cost = CostModel(
        f=[rng.uniform(0.5, 2) for _ in range(n)],
        b=[rng.uniform(0.5, 2) for _ in range(n)],
        w=[rng.uniform(0, 1) for _ in range(n)],
        comm=rng.choice([0.0, 0.3]),
    )
    got = [[(e.start, e.end) for e in row] for row in simulate(schedule, cost).events]
    want = _reference(schedule, cost)
    for r, (g, w) in enumerate(zip(got, want)):
        assert [t for pair in g for t in pair] == pytest.approx([t for pair in w for t in pair], abs=1e-9), f"rank {r}"


@pytest.mark.parametrize("name", sorted(n for n, info in SCHEDULES.items() if not info.synchronous))
def test_concatenated_streams_already_wait_at_each_drain(name: str) -> None:
    """A run drained for evaluation waits for every rank between streams; its concatenated schedule's
    simulation does too, with no barrier of its own: the first rank drains last and starts the next first."""
    from pipeweave.schedule.stream import concatenate

    rng = random.Random(name)
    d = 3
    for _ in range(4):
        segments = [generate(name, num_stages=d, num_microbatches=d, num_steps=rng.randint(1, 3) * 2) for _ in range(3)]
        n = segments[0].num_parts
        cost = CostModel(
            f=[rng.uniform(0.5, 2) for _ in range(n)],
            b=[rng.uniform(0.5, 2) for _ in range(n)],
            w=[rng.uniform(0.1, 1) for _ in range(n)],
            u=[rng.uniform(0, 0.5) for _ in range(n)],
            comm=rng.choice([0.0, 0.3]),
        )
        whole = simulate(concatenate(segments), cost)
        offset, ends = 0.0, []
        for seg in segments:  # each stream on its own, after every rank has ended the last
            alone = simulate(seg, cost)
            ends.append([[t + offset for e in row for t in (e.start, e.end)] for row in alone.events])
            offset = max(row[-1].end for row in alone.events if row) + offset
        for r, row in enumerate(whole.events):
            assert [t for e in row for t in (e.start, e.end)] == pytest.approx(sum((seg[r] for seg in ends), [])), r
