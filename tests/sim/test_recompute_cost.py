"""Recomputation in the cost model: a replay before each backward, the kept share of M_a (``CostModel.recompute``)."""

from __future__ import annotations

import json

import pytest

from pipeweave.cli import main
from pipeweave.errors import UserError
from pipeweave.schedule import generate
from pipeweave.sim import CostModel, compute_metrics, simulate


def test_a_recomputing_part_replays_before_its_backward_and_keeps_its_share() -> None:
    cost = CostModel(f=2.0, b=3.0, w=1.0, recompute="full,selective,none", replay_selective=0.5,
                     kept_selective=0.4, kept_full=0.1)
    parts = cost.for_parts(num_parts=3, num_ranks=3)
    assert parts.b == (5.0, 3.5, 3.0) and parts.f == (2.0,) * 3 and parts.w == (1.0,) * 3
    assert parts.activation == pytest.approx((0.1, 0.4, 1.0)) and parts.recompute == ("full", "selective", "none")
    # 1F1B at D = 3: rank r holds 3 - r microbatches, each what its part keeps.
    metrics = compute_metrics(simulate(generate("1f1b", num_stages=3, num_microbatches=6), cost))
    assert metrics.peak_activations == pytest.approx((0.3, 0.8, 1.0))


def test_simulate_json_reflects_recomputation(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["simulate", "--stages", "4", "--microbatches", "8", "--json"]
    assert main(flags) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*flags, "--recompute", "full,none,none,none", "--activation-full", "0.25"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost"]["recompute"] == "full,none,none,none"
    assert out["peak_activations"] == [1.0, 3.0, 2.0, 1.0] and plain["peak_activations"] == [4.0, 3.0, 2.0, 1.0]
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
