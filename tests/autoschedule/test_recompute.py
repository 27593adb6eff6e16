"""The joint choice of recomputation per part and zero-bubble schedule against every assignment (small cases)."""

from __future__ import annotations

import itertools

import pytest

from pipeweave.autoschedule.build import to_schedule
from pipeweave.autoschedule.heuristic import heuristic
from pipeweave.autoschedule.problem import Problem
from pipeweave.autoschedule.recompute import choose_recompute, recompute_problem, with_recompute
from pipeweave.errors import UserError
from pipeweave.schedule.ir import ScheduleError
from pipeweave.sim import CostModel, compute_metrics, simulate

COST = CostModel(f=1.0, b=1.0, w=1.0, replay_selective=0.4, kept_selective=0.55, kept_full=0.08)
BUDGET = {"work_budget": 0, "timed": True}
"""The heuristic's first policy and the paper's timed warm-ups, on both sides of the comparison (its full
policy search, 81 times over, would take minutes)."""


def _brute_force(problem: Problem) -> float:
    """The shortest heuristic step over every assignment of none, selective, full to the parts."""
    best = float("inf")
    for modes in itertools.product(("none", "selective", "full"), repeat=problem.num_parts):
        try:
            instance = with_recompute(problem, modes)
        except ScheduleError:
            continue
        best = min(best, heuristic(instance, **BUDGET).span)
    return best


@pytest.mark.parametrize(
    ("stages", "microbatches", "limit"), [(3, 6, 0.5), (3, 9, 0.8), (4, 8, 0.35), (4, 8, 0.6), (4, 8, 0.8)]
)
def test_the_choice_is_within_5_percent_of_every_assignment(stages: int, microbatches: int, limit: float) -> None:
    problem = recompute_problem(stages, microbatches, vshape=False, cost=COST, activation_limit=limit)
    modes, result = choose_recompute(problem, **BUDGET)
    chosen = with_recompute(problem, modes)
    # The chosen schedule simulated under its own recomputation: its step, and its memory within the limit.
    metrics = compute_metrics(simulate(to_schedule(chosen, result.order), chosen.cost))
    assert all(p <= lim + 1e-9 for p, lim in zip(metrics.peak_activations, chosen.peak_limit))
    assert max(metrics.span) == pytest.approx(result.span)
    best = _brute_force(problem)
    assert result.span <= 1.05 * best, modes  # the contract (issue 20)
    # Here the candidates hold a best assignment (measured): one mode everywhere would be 2.5-4 % slower.
    assert result.span <= best * (1 + 1e-9), modes
    # Plain 1F1B does not fit this limit on rank 0, so something recomputes.
    assert limit < 1.0 and any(m != "none" for m in modes)


def test_a_limit_no_choice_reaches_names_the_smallest_reachable() -> None:
    with pytest.raises(
        UserError,
        match=r"^--activation-limit 0.01 is below what any recomputation reaches; the "
        r"smallest reachable is K=0.25 \(every part recomputing in full\)$",
    ):
        recompute_problem(4, 8, vshape=False, cost=COST, activation_limit=0.01)
    # (0.08 + 0.92) / 4: one microbatch's input kept, and the rest replayed while its backward runs
    recompute_problem(4, 8, vshape=False, cost=COST, activation_limit=0.25)


def test_search_says_what_it_chose(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pipeweave.cli import main

    flags = [
        "search",
        "--stages",
        "3",
        "--microbatches",
        "6",
        "--time-limit",
        "2",
        "--solver",
        "heuristic",
        "--time-selective",
        "0.4",
        "--activation-selective",
        "0.55",
        "--activation-full",
        "0.08",
    ]
    assert main([*flags, "--recompute", "auto", "--activation-limit", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # test_the_choice_is_within...'s case; full,full,none ties it (step 24.0), the lighter replay is found first
    assert out["recompute_chosen"] and out["recompute"] == "full,selective,none"
    assert max(out["peak_activations"]) <= 0.5 * 3
    assert main([*flags, "--recompute", "auto", "--activation-limit", "0.5"]) == 0
    assert "recompute full,selective,none (chosen per part with the schedule)" in capsys.readouterr().out
