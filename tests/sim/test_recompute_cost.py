"""Recomputation in the cost model: a replay before each backward, the kept share of M_a (``CostModel.recompute``)."""

from __future__ import annotations

import json

import pytest

from pipeweave.cli import main
from pipeweave.errors import UserError
from pipeweave.schedule import generate
from pipeweave.sim import CostModel, compute_metrics, simulate


def test_a_recomputing_part_replays_before_its_backward_and_keeps_its_share() -> None:
    cost = CostModel(
        f=2.0, b=3.0, w=1.0, recompute="full,selective,none", replay_selective=0.5, kept_selective=0.4, kept_full=0.1
    )
    parts = cost.for_parts(num_parts=3, num_ranks=3)
    assert parts.b == (5.0, 3.5, 3.0) and parts.f == (2.0,) * 3 and parts.w == (1.0,) * 3
    assert parts.activation == pytest.approx((0.1, 0.4, 1.0)) and parts.recompute == ("full", "selective", "none")
    # Full recomputation replays the whole part before its backward; selective a layer's region inside it
    assert parts.replayed == pytest.approx((0.9, 0.0, 0.0))
    # 1F1B at D = 3: rank r holds 3 - r microbatches, each what its part keeps, and (full) at its first
    # backward the replayed rest of one microbatch on top: 3 x 0.1 + 0.9, 2 x 0.4, 1.
    metrics = compute_metrics(simulate(generate("1f1b", num_stages=3, num_microbatches=6), cost))
    assert metrics.peak_activations == pytest.approx((1.2, 0.8, 1.0))


def test_simulate_json_reflects_recomputation(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["simulate", "--stages", "4", "--microbatches", "8", "--json"]
    assert main(flags) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*flags, "--recompute", "full,none,none,none", "--activation-full", "0.25"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost"]["recompute"] == "full,none,none,none"
    # rank 0: four microbatches at 0.25, and one replayed whole during its backward
    assert out["peak_activations"] == [1.75, 3.0, 2.0, 1.0] and plain["peak_activations"] == [4.0, 3.0, 2.0, 1.0]
    assert out["makespan"] > plain["makespan"]  # rank 0's eight backwards each replay a forward


def test_bad_recomputation_costs_are_one_line() -> None:
    with pytest.raises(UserError, match="kept_full=1.5 is invalid; give fractions of M_a in"):
        CostModel(kept_full=1.5)
    with pytest.raises(UserError, match="gives 2 modes for 3 parts"):
        CostModel(recompute="full,none").for_parts(num_parts=3, num_ranks=3)


def test_simulate_refuses_auto_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--recompute", "auto"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--recompute auto is chosen under a memory limit by search and partition" in err and "\n" not in err


def test_the_replay_is_counted_with_the_memory_levers_too() -> None:
    """``simulate_levers`` times the peaks by its own events: with no lever it finds the plain simulator's peaks,
    and a backward's replay is on top there too (1F1B, D = 2, full recomputation keeping 0.1 of M_a)."""
    from pipeweave.schedule.levers import StashPlan
    from pipeweave.sim.levers import simulate_levers

    schedule = generate("1f1b", num_stages=2, num_microbatches=4)
    cost = CostModel(recompute="full", kept_full=0.1)
    plain = compute_metrics(simulate(schedule, cost)).peak_activations
    levered = simulate_levers(schedule, cost.for_parts(num_parts=2, num_ranks=2), StashPlan())[0].peak_activations
    assert plain == levered == pytest.approx((2 * 0.1 + 0.9, 0.1 + 0.9))
    # part 0 offloaded: held only while its F or backward runs, the replay on top of its reload
    offloaded = simulate_levers(schedule, cost.for_parts(num_parts=2, num_ranks=2), StashPlan(offload=frozenset({0})))[
        0
    ].peak_activations
    assert offloaded[0] == pytest.approx(0.1 + 0.9)
