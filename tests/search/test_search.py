"""Automatic zero-bubble search: validity, bound soundness, exactness on small instances."""

from __future__ import annotations

import time

import pytest

from pipeweave.schedule import generate, validate
from pipeweave.search import exact, heuristic, lower_bound, problem_from_times
from pipeweave.search.build import finish
from pipeweave.search.problem import Problem
from pipeweave.sim.cost import CostModel

# (D, T, K, vshape, f, b, w, comm): uniform, uneven-ish times with comm, a V.
CASES = [
    (4, 8, 1, False, 1.0, 1.0, 1.0, 0.0),
    (4, 8, 2, False, 1.0, 1.0, 1.0, 0.0),
    (3, 6, 1, False, 1.0, 2.0, 1.0, 0.5),
    (4, 8, 1, True, 1.0, 1.0, 1.0, 0.0),
    (4, 6, 1.5, True, 2.0, 1.0, 1.0, 0.3),
]


def _problem(case: tuple) -> Problem:  # type: ignore[type-arg]
    d, t, k, v, f, b, w, c = case
    return problem_from_times(d, t, vshape=v, time_f=f, time_b=b, time_w=w, time_comm=c, memory_limit=k)


@pytest.mark.parametrize("case", CASES)
def test_heuristic_is_valid_within_memory_and_not_below_the_bound(case: tuple) -> None:  # type: ignore[type-arg]
    problem = _problem(case)
    result = heuristic(problem)
    checked = finish(problem, result.order, lower_bound=lower_bound(problem), solver="heuristic",
                     solver_time=0.0, status="heuristic")  # validates and checks memory
    assert abs(checked.span - result.span) < 1e-9  # the list schedule's times are the simulator's
    assert checked.span >= lower_bound(problem) - 1e-9
    assert all(p <= lim + 1e-9 for p, lim in zip(checked.metrics.peak_activations, problem.limit))


def test_bound_matches_closed_forms_where_they_hold() -> None:
    # f = b = w = 1, no comm: ZB-H2's zero bubble at 2D M_a, ZB-H1's (D-1)(f+b-w) at D M_a.
    d, t = 4, 8
    assert lower_bound(problem_from_times(d, t, memory_limit=2)) == pytest.approx(3 * t)
    assert lower_bound(problem_from_times(d, t, memory_limit=1)) == pytest.approx(3 * t + (d - 1) * 1)
    # and the heuristic reaches both, so both are optimal
    assert heuristic(problem_from_times(d, t, memory_limit=2)).span == pytest.approx(3 * t)
    assert heuristic(problem_from_times(d, t, memory_limit=1)).span == pytest.approx(3 * t + d - 1)


def test_bound_reproduces_the_papers_zb_1p_rows() -> None:
    # REFERENCE.md, 1.5B model, p = 8: the published ZB-1p bubble rates are this bound's.
    for m, f, b, w, c, published in [(24, 18.522, 18.086, 9.337, 0.601, 0.1585),
                                     (32, 18.513, 18.086, 9.331, 0.626, 0.1242),
                                     (64, 18.546, 18.097, 9.321, 0.762, 0.0674)]:
        p = problem_from_times(8, m, time_f=f, time_b=b, time_w=w, time_comm=c, memory_limit=1)
        assert 1 - p.work(0) / lower_bound(p) == pytest.approx(published, abs=6e-5)


@pytest.mark.parametrize("solver", ["cpsat", "highs"])
def test_exact_proves_small_instances_optimal(solver: str) -> None:
    problem = _problem(CASES[2])
    start = time.perf_counter()
    result = exact(problem, solver=solver, time_limit=30, workers=1)
    assert time.perf_counter() - start < 60
    validate(result.schedule)
    assert result.gap == 0.0 and result.status == "optimal"
    assert result.span <= heuristic(problem).span + 1e-9
    assert result.span >= lower_bound(problem) - 1e-9
    assert result.span == pytest.approx(32.0)  # both solvers agree (CP-SAT and HiGHS)


def test_exact_is_never_worse_than_the_heuristic_nor_below_the_bound() -> None:
    problem = _problem(CASES[4])  # a V with uneven times: not proven within the limit
    result = exact(problem, solver="cpsat", time_limit=3, workers=1)
    validate(result.schedule)
    assert lower_bound(problem) - 1e-9 <= result.lower_bound <= result.span <= heuristic(problem).span + 1e-9


def test_uneven_parts_are_accepted() -> None:
    cost = CostModel(f=(1.0, 2.0, 1.0), b=(1.0, 2.0, 1.5), w=(0.5, 1.0, 0.5), comm=0.2)
    problem = Problem(num_stages=3, num_microbatches=5, cost=cost, memory_limit=1)
    result = exact(problem, solver="heuristic")
    validate(result.schedule)
    assert result.span >= result.lower_bound >= max(problem.work(r) for r in range(3)) - 1e-9


def test_registry_names_validate() -> None:
    for name, k in [("zb-auto", 1.0), ("zb-auto", 2.0), ("zb-v-auto", 1.0)]:
        validate(generate(name, num_stages=4, num_microbatches=8, memory_limit=k))


@pytest.mark.slow
def test_heuristic_handles_32_by_256_in_about_a_second() -> None:
    problem = problem_from_times(32, 256, memory_limit=1, time_comm=0.1)
    start = time.perf_counter()
    result = heuristic(problem)
    elapsed = time.perf_counter() - start
    assert result.span >= lower_bound(problem)
    assert elapsed < 2.0  # under 1 s on an idle core; headroom for a shared CI machine
