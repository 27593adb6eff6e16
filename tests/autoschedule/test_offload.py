"""The joint choice of offloaded parts and zero-bubble schedule against every set of parts (small cases)."""

from __future__ import annotations

import itertools
import json

import pytest

from pipeweave.autoschedule.build import simulated_metrics, to_schedule
from pipeweave.autoschedule.offload import candidates, choose_offload, offload_problem, offloaded_step
from pipeweave.autoschedule.problem import Problem
from pipeweave.cli import main
from pipeweave.schedule import generate
from pipeweave.schedule.ir import ScheduleError
from pipeweave.sim import CostModel, compute_metrics, simulate

BUDGET = {"work_budget": 0, "timed": True}
"""The heuristic's first policy and the paper's timed warm-ups, on both sides of the comparison."""
UNEVEN = CostModel(f=[1.0, 1.2, 0.9, 1.1], b=[1.0, 1.3, 1.0, 1.0], w=[1.0] * 4, activation=[1.2, 1.0, 1.0, 0.8])


def _brute_force(problem: Problem) -> float:
    """The shortest simulated step within the limit over every set of offloaded parts."""
    n = problem.num_parts
    sets = itertools.chain.from_iterable(itertools.combinations(range(n), k) for k in range(n + 1))
    return min(found[0] for parts in sets if (found := offloaded_step(problem, frozenset(parts), **BUDGET)))


@pytest.mark.parametrize(
    ("stages", "microbatches", "vshape", "cost", "limit", "bandwidth"),
    [
        (3, 6, False, CostModel(), 0.4, 1.0),
        (4, 8, False, CostModel(), 0.5, 4.0),
        (4, 8, False, UNEVEN, 0.6, 4.0),
        (3, 6, True, CostModel(), 0.6, 4.0),
        (4, 8, True, CostModel(), 0.5, 4.0),
    ],
)
def test_the_choice_is_within_5_percent_of_every_set(
    stages: int, microbatches: int, vshape: bool, cost: CostModel, limit: float, bandwidth: float
) -> None:
    problem = offload_problem(
        stages, microbatches, vshape=vshape, cost=cost, activation_limit=limit, host_bandwidth=bandwidth
    )
    parts, result = choose_offload(problem, **BUDGET)
    chosen = Problem(
        num_stages=stages,
        num_microbatches=microbatches,
        vshape=vshape,
        cost=cost,
        activation_limit=limit,
        host_bandwidth=bandwidth,
        offload=parts,
    )
    # Its schedule simulated with the memory actions: the heuristic's step, and peaks within the limit.
    metrics = simulated_metrics(chosen, to_schedule(chosen, result.order))
    assert max(metrics.span) == pytest.approx(result.span)
    assert all(p <= lim + 1e-9 for p, lim in zip(metrics.peak_activations, chosen.limit))
    assert result.span <= 1.05 * _brute_force(problem), sorted(parts)  # the contract (issue 20)
    # Plain 1F1B exceeds the limit on rank 0, and offloading is what the choice does about it.
    plain = compute_metrics(simulate(generate("1f1b", num_stages=stages, num_microbatches=microbatches), cost))
    assert vshape or plain.peak_activations[0] > chosen.limit[0]
    assert parts and result.span < offloaded_step(problem, frozenset(), **BUDGET)[0]  # type: ignore[index]


def test_an_offloaded_stage_holds_only_what_runs_and_w_needs() -> None:
    """At K = 1/2 rank 0 may hold 2 M_a: offloaded, it warms up deeper than its limit would let it keep."""
    problem = offload_problem(4, 8, vshape=False, cost=CostModel(), activation_limit=0.5, host_bandwidth=4.0)
    instance = Problem(
        num_stages=4, num_microbatches=8, activation_limit=0.5, host_bandwidth=4.0, offload=frozenset({0})
    )
    assert instance.costs.f[0] == 1.25 and instance.costs.b[0] == 1.25 and instance.costs.f[1] == 1.0
    found = offloaded_step(problem, frozenset({0}), **BUDGET)
    assert found is not None
    row = found[1].order[0]
    warm_up = next(k for k, a in enumerate(row) if a.op.value != "F")
    assert warm_up > 2  # more microbatches in flight than 2 M_a would hold without offload


def test_a_limit_no_offload_reaches_names_the_smallest_reachable() -> None:
    with pytest.raises(
        ScheduleError,
        match=r"^--activation-limit 0.1 is below what any offload reaches; the "
        r"smallest reachable is K=0.125 \(every part offloaded\)$",
    ):
        offload_problem(4, 8, vshape=True, cost=CostModel(), activation_limit=0.1, host_bandwidth=1.0)
    offload_problem(4, 8, vshape=True, cost=CostModel(), activation_limit=0.125, host_bandwidth=1.0)  # one chunk


def test_search_says_what_it_offloaded(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [
        "search",
        "--stages",
        "3",
        "--microbatches",
        "6",
        "--activation-limit",
        "0.5",
        "--solver",
        "heuristic",
        "--host-bandwidth",
        "4",
        "--offload",
        "auto",
    ]
    assert main([*flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["offload_chosen"] and out["offload"] and out["memory_levers"]["offload"] == out["offload"]
    assert max(out["peak_activations"]) <= 0.5 * 3
    # The same parts given by hand are searched with their memory and copies too: the same schedule.
    assert main([*flags[:-1], ",".join(map(str, out["offload"])), "--json"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["span"] == out["span"] and not fixed["offload_chosen"] and fixed["offload"] == out["offload"]
    assert main(flags) == 0
    assert f"offload {','.join(map(str, out['offload']))} (chosen per part with the schedule" in capsys.readouterr().out
    assert main([*flags[:-1], "auto", "--recompute", "auto"]) == 2
    assert "--recompute auto and --offload auto are chosen one at a time" in capsys.readouterr().err
    assert main(["simulate", "-s", "1f1b", "--stages", "2", "--microbatches", "2", "--offload", "auto"]) == 2
    assert "--offload auto is chosen by `pipeweave search`" in capsys.readouterr().err


def test_the_heuristic_keeps_every_offloaded_schedule_within_the_limit() -> None:
    """An offloaded I brings its microbatch back: the heuristic runs a pending W first when that would not
    fit, so no set of parts is lost to a reload over the limit."""
    problem = offload_problem(4, 8, vshape=False, cost=CostModel(), activation_limit=0.5, host_bandwidth=1.0)
    for parts in candidates(problem):
        assert offloaded_step(problem, parts, **BUDGET) is not None, sorted(parts)
