"""PipeDream's replicated stages (1F1B-RR): the order, its routes, the validator and the simulator on it."""

from __future__ import annotations

import pytest

from pipeweave.schedule import ScheduleError, generate, lower, parse_action, validate
from pipeweave.schedule.ir import Op
from pipeweave.schedule.round_robin import averages_replicas, minibatch_pipelines, replica_in_flight
from pipeweave.schedule.stream import peak_in_flight
from pipeweave.schedule.validate import InvalidSchedule
from pipeweave.sim.cost import CostModel
from pipeweave.sim.metrics import compute_metrics
from pipeweave.sim.timeline import simulate
from pipeweave.sim.versions import staleness, weight_copies

GOLDEN_2_1 = """
rank 0 | F0 F2 B0 U0 F4 B2 U1 F6 B4 U2 B6 U3
rank 1 | F1 F3 B1 U0 F5 B3 U1 F7 B5 U2 B7 U3
rank 2 | F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4 F5 B5 U5 F6 B6 U6 F7 B7 U7
"""


def _picture(schedule: object) -> str:
    rows = [" ".join(str(a)[1:] for a in row) for row in schedule.actions]  # type: ignore[attr-defined]
    return "\n" + "\n".join(f"rank {r} | {row}" for r, row in enumerate(rows)) + "\n"


def test_golden_two_replicas_of_part_0_then_one_of_part_1() -> None:
    """Part 0 on ranks 0 and 1 (even, odd microbatches), NOAM = ceil(3 / 2) = 2 in flight at each."""
    s = generate("pipedream", num_stages=3, num_microbatches=4, num_steps=2, replicas=(2, 1))
    assert _picture(s) == GOLDEN_2_1
    assert s.placement.pipelines == ((0, 2), (1, 2)) and s.placement.shared
    assert [s.route(j) for j in range(3)] == [(0, 2), (1, 2), (0, 2)]
    assert averages_replicas(s) and minibatch_pipelines(s) == 1
    validate(s)


REPLICATIONS = [(2, 1), (1, 2), (2, 2), (1, 2, 1), (2, 1, 1), (1, 1, 2), (3, 1), (2, 3), (1, 3)]


@pytest.mark.parametrize("replicas", REPLICATIONS, ids=lambda r: ",".join(map(str, r)))
def test_validator_accepts_every_replication_and_routes_are_round_robin(replicas: tuple[int, ...]) -> None:
    d, lcm = sum(replicas), {(2, 3): 6, (3, 1): 3, (1, 3): 3}.get(replicas, 2)
    for t in (lcm, 2 * lcm):
        for in_flight in (None, 1, 2, 5):
            for vertical_sync in (False, True):
                s = generate(
                    "pipedream",
                    num_stages=d,
                    num_microbatches=t,
                    num_steps=2,
                    replicas=replicas,
                    in_flight=in_flight,
                    vertical_sync=vertical_sync,
                )
                validate(s)
                lower(s)
    s = generate("pipedream", num_stages=d, num_microbatches=2 * lcm, num_steps=2, replicas=replicas)
    first = [sum(replicas[:k]) for k in range(len(replicas))]
    for row in s.actions:
        (part,) = {s.placement.stage_part[a.stage] for a in row}
        for a in row:
            if a.op is not Op.U:  # microbatch m on replica m mod r_k of part k, its F and its B
                assert a.stage == first[part] + a.microbatch % replicas[part]
    updates = [sum(a.op is Op.U for a in row) for row in s.actions]
    for part, r in enumerate(replicas):  # the replicas of a part update together (their all-reduce)
        assert len({updates[first[part] + i] for i in range(r)}) == 1


def test_noam_is_admitted_at_each_input_replica_and_in_flight_overrides() -> None:
    """NOAM = ceil(workers / input replicas): at each input replica; downstream ceil(W_k / r_k)."""
    s = generate("pipedream", num_stages=4, num_microbatches=4, replicas=(2, 1, 1))
    assert [peak_in_flight(row, r) for r, row in enumerate(s.actions)] == [2, 2, 2, 1]
    s = generate("pipedream", num_stages=3, num_microbatches=4, replicas=(1, 2))
    assert [peak_in_flight(row, r) for r, row in enumerate(s.actions)] == [3, 1, 1]
    s = generate("pipedream", num_stages=4, num_microbatches=4, replicas=(2, 1, 1), in_flight=1)
    assert [peak_in_flight(row, r) for r, row in enumerate(s.actions)] == [1, 1, 1, 1]
    assert replica_in_flight([1, 1, 1, 1], 4) == [4, 3, 2, 1]  # the straight pipeline: D - k


def test_unreplicated_counts_are_the_straight_schedule() -> None:
    assert generate("pipedream", num_stages=3, num_microbatches=4, replicas=(1, 1, 1)) == generate(
        "pipedream", num_stages=3, num_microbatches=4
    )


@pytest.mark.parametrize(
    ("replicas", "stages", "micro", "message"),
    [
        ((2, 1), 4, 4, "stage replicas 2,1 need 3 processes but the pipeline has 4; give --stages 3"),
        ((2, 1), 3, 3, "3 microbatches do not deal evenly to 2 replicas; give --microbatches a multiple of 2"),
        ((2, 0), 2, 4, "stage replicas 2,0 are invalid; give one count >= 1 per part"),
    ],
)
def test_replications_the_ranks_cannot_hold_are_one_line(
    replicas: tuple[int, ...], stages: int, micro: int, message: str
) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        generate("pipedream", num_stages=stages, num_microbatches=micro, replicas=replicas)
    assert "\n" not in str(info.value)


def _copies(s: object) -> list[float]:
    parts, ranks = s.num_parts, s.num_ranks  # type: ignore[attr-defined]
    return list(weight_copies(s, CostModel(weight=[1.0] * parts).for_parts(num_parts=parts, num_ranks=ranks)))  # type: ignore[arg-type]


def test_simulator_staleness_and_weight_copies_per_replica() -> None:
    """A replica of part k holds ceil(W_k / r_k) versions (its microbatches in flight) and its gradients lag
    that many updates less one; the run's measured ones are compared in tests/runtime/test_replicated_stages."""
    s = generate("pipedream", num_stages=3, num_microbatches=4, num_steps=4, replicas=(2, 1))
    assert staleness(s) == (1, 1, 0)
    assert _copies(s) == [2.0, 2.0, 1.0]
    s = generate("pipedream", num_stages=4, num_microbatches=4, num_steps=4, replicas=(1, 2, 1))
    assert staleness(s) == (3, 1, 1, 0)
    assert _copies(s) == [4.0, 2.0, 2.0, 1.0]


def test_a_part_replicated_as_the_planner_balances_it_fills_the_pipeline_as_a_straight_one() -> None:
    """Part 0 twice as slow on two replicas (PipeDream's T(i..j, m) = compute / m) against three equal parts:
    the same bubble, warm-up and drain only (the simulator walks a shared stage's neighbours per microbatch)."""
    replicated = generate("pipedream", num_stages=3, num_microbatches=4, num_steps=8, replicas=(2, 1))
    straight = generate("pipedream", num_stages=3, num_microbatches=4, num_steps=8)
    slow = CostModel(f=[2.0, 1.0], b=[4.0, 2.0], w=[2.0, 1.0])
    bubble = compute_metrics(simulate(replicated, slow)).bubble_ratio
    assert bubble == pytest.approx(compute_metrics(simulate(straight)).bubble_ratio)
    assert bubble < 0.1


def test_validator_sees_the_replicas_meet_at_every_update() -> None:
    """1F1B-RR's replicas all-reduce at U(., k): an order where replica 1 reaches its U0 only after a
    backward that waits (through part 1's order) on replica 0's F2, which replica 0 runs after its U0,
    deadlocks at run time; the validator says so, and the simulator times each U at the last replica's."""
    rows = [
        "0F0 0B0 0U0 0F2 0B2 0F4 0B4 0F6 0B6 0U1",
        "1F1 1F3 1B1 1B3 1U0 1F5 1F7 1B5 1B7 1U1",  # U0 after 1B3, which needs 2B2, which needs 0F2
        " ".join(f"2F{j} 2B{j} 2U{j}" for j in range(8)),
    ]
    s = generate("pipedream", num_stages=3, num_microbatches=8, num_steps=1, replicas=(2, 1))
    bad = s.with_actions([[parse_action(t) for t in row.split()] for row in rows])
    with pytest.raises(InvalidSchedule, match="0U0 waits for every weight gradient of part 0"):
        validate(bad)
    timeline = simulate(s)  # at f = b = 1: replica 1's U0 waits for its own B1 and for replica 0's B0
    at = {str(e.action): e for row in timeline.events for e in row}
    assert at["0U0"].start == at["1U0"].start == max(at["0B0"].end, at["1B1"].end) > at["0B0"].end
