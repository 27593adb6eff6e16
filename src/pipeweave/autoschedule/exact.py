"""Exact search for zero-bubble schedules (after the ILP of Qi et al., ICLR 2024, appendix G).

The instance becomes a scheduling model with integer times (``exact_model.py``):
one start time per F, I and W; the dependencies of the IR with a hop of
communication between ranks; no two actions of a rank at once; and the memory
limit on each rank's running sum. Each stage runs its F, its I and its W in
microbatch order: the microbatches are identical, so relabelling them turns any
schedule into one that does, with the same times and memory (an exchange
argument), and the symmetry cut loses no optimum. The objective is the max
span, max over ranks r of (end of r's last action - S_r), where S_r, the start
of r's first action F(r, 0), is the same for every order; it is what the bubble
rate measures once steps overlap (section 4's post-validation removes the
barrier before the step).

Two back-ends share the model: CP-SAT (``cpsat.py``: intervals, no-overlap,
a reservoir per rank) and a MILP on HiGHS (``milp.py``: big-M order binaries),
both warm-started from the heuristic, run in a child process
(``isolate.py``) and stopped at the search's time limit with their best-so-far.
"""

from __future__ import annotations

import dataclasses
import math
import time

from pipeweave.autoschedule.bound import lower_bound
from pipeweave.autoschedule.build import SearchResult, finish
from pipeweave.autoschedule.exact_model import (
    Model,
    Solved,
    build_model,
    incumbent_starts,
    order_from_starts,
)
from pipeweave.autoschedule.heuristic import Result, evaluate, heuristic
from pipeweave.autoschedule.isolate import Budget, solve_isolated
from pipeweave.autoschedule.problem import Problem
from pipeweave.schedule.ir import Action

SOLVERS = ("cpsat", "highs", "heuristic")
DEFAULT_SOLVER = "cpsat"  # measured faster and tighter than HiGHS: benchmarks/search/README.md


def exact(
    problem: Problem,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit: float = 10.0,
    workers: int = 0,
    heuristic_budget: float | None = None,
    work_limit: float | None = None,
    seed: int = 0,
) -> SearchResult:
    """The best schedule a time-limited exact search finds, warm-started from the heuristic.

    Never worse than the heuristic (it is the incumbent), never below the bound.

    Args:
        problem: the instance.
        solver: "cpsat", "highs", or "heuristic" (no exact search).
        time_limit: seconds for the whole search (heuristic, model, solver): the
            solver is stopped then, keeping its best-so-far; checking and
            simulating the result come on top (about a second at D=32, T=256).
        workers: solver threads (0: the solver's default).
        heuristic_budget: wall seconds for the heuristic's policy search (None: its
            deterministic work budget alone).
        work_limit: CP-SAT's deterministic time (its own seconds; None: only the
            time limit). With ``workers=1`` and a work limit that binds before
            the time limit, the result is the same on every run and machine.
        seed: CP-SAT's random seed.

    Raises:
        ScheduleError: an unknown solver, or a time limit that is not positive.

    Example:
        >>> from pipeweave.autoschedule.problem import problem_from_times
        >>> r = exact(problem_from_times(2, 3, activation_limit=1), time_limit=5)
        >>> r.span, r.gap
        (10.0, 0.0)
    """
    from pipeweave.schedule.ir import ScheduleError

    if solver not in SOLVERS:
        raise ScheduleError(f"solver={solver!r} is unknown; choose one of {', '.join(SOLVERS)}")
    if not time_limit > 0:
        raise ScheduleError(f"time_limit={time_limit!r} is invalid; give seconds > 0")
    t0 = time.perf_counter()
    best: Result = heuristic(problem, budget_s=heuristic_budget)
    bound = lower_bound(problem)
    status = "heuristic"
    if solver != "heuristic" and best.span - bound > 1e-9 * best.span:
        model = build_model(problem, best.span)
        warm = incumbent_starts(model, best.order)
        budget = Budget(t0 + time_limit, workers, work_limit, seed)
        solved = solve_isolated(solver, model, warm, budget)
        if model.exact and solved.bound > -math.inf:
            bound = max(bound, solved.bound / model.time_scale)
        status = solved.status
        if solved.order is not None:
            candidate = _checked(problem, solved.order)
            if candidate is not None and candidate.span < best.span - 1e-12:
                best = candidate
    elif solver != "heuristic":
        status = "optimal"  # the heuristic meets the bound
    result = finish(
        problem, best.order, lower_bound=bound, solver=solver, solver_time=time.perf_counter() - t0, status=status
    )
    if result.gap == 0.0 and status != "optimal":  # the hand bound closed what the solver left open
        result = dataclasses.replace(result, status="optimal")
    return result


def _checked(problem: Problem, order: list[list[Action]]) -> Result | None:
    """The order's simulated result if it completes within memory (rounding can break it)."""
    from pipeweave.autoschedule.build import to_schedule
    from pipeweave.schedule.dataflow import execute
    from pipeweave.sim.metrics import peak_activations
    from pipeweave.sim.timeline import simulate

    schedule = to_schedule(problem, order, updates=False)
    if not execute(schedule).complete:
        return None
    timeline = simulate(schedule, problem.cost, check=False)
    peaks = peak_activations(timeline, problem.costs)
    if any(p > lim + 1e-6 for p, lim in zip(peaks, problem.peak_limit)):
        return None
    return evaluate(problem, order)


__all__ = [
    "DEFAULT_SOLVER",
    "SOLVERS",
    "Model",
    "Solved",
    "build_model",
    "exact",
    "incumbent_starts",
    "order_from_starts",
    "solve_isolated",
]
