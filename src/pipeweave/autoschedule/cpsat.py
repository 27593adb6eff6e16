"""The exact search on CP-SAT (OR-Tools): intervals, one no-overlap and one reservoir per rank."""

from __future__ import annotations

from collections.abc import Callable

from ortools.sat.python import cp_model

from pipeweave.autoschedule.exact_model import Model, Solved, order_from_starts


class _Stream(cp_model.CpSolverSolutionCallback):
    """Hands every improving solution's start times to ``report`` (the parent keeps the last)."""

    def __init__(self, start: list[cp_model.IntVar], report: Callable[[list[int]], None]) -> None:
        super().__init__()
        self.start, self.report = start, report

    def on_solution_callback(self) -> None:
        self.report([self.value(s) for s in self.start])


def solve_cpsat(
    model: Model,
    warm: list[int],
    time_limit: float,
    workers: int,
    *,
    work_limit: float | None = None,
    seed: int = 0,
    on_solution: Callable[[list[int]], None] | None = None,
) -> Solved:
    """Minimise the max span of ``model`` with CP-SAT, hinted with the ``warm`` starts.

    Run it through ``exact.exact`` (or ``isolate.solve_isolated``): this solver's
    library must not share a process with the other one's. ``work_limit`` is
    CP-SAT's deterministic time; ``on_solution`` receives each improving
    solution's starts.

    Example:
        >>> from pipeweave.autoschedule.exact import exact
        >>> from pipeweave.autoschedule.problem import Problem
        >>> exact(Problem(num_stages=2, num_microbatches=2), solver="cpsat", time_limit=5).status
        'optimal'
    """
    cp = cp_model.CpModel()
    n = len(model.actions)
    start = [cp.new_int_var(model.release[i], model.horizon - model.duration[i], f"s{i}") for i in range(n)]
    interval = [cp.new_fixed_size_interval_var(start[i], model.duration[i], f"x{i}") for i in range(n)]
    for i in range(n):
        for p, lag in model.preds[i]:
            cp.add(start[i] >= start[p] + lag)
    span = cp.new_int_var(0, model.horizon, "span")
    for r, members in enumerate(model.rank_actions):
        cp.add_no_overlap([interval[i] for i in members])
        times = [start[i] + (model.duration[i] if model.delta_sign(i) < 0 else 0) for i in members]
        changes = [model.delta_signed(i) for i in members]
        cp.add_reservoir_constraint(times, changes, 0, model.limit[r])
        for i in members:  # the last W of each stage ends the rank; bounding all is simpler and as tight
            cp.add(span >= start[i] + model.duration[i] - model.start[r])
    cp.minimize(span)
    for i in range(n):
        cp.add_hint(start[i], warm[i])
    cp.add_hint(span, max(warm[i] + model.duration[i] - model.start[model.rank_of[i]] for i in range(n)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    if workers:
        solver.parameters.num_workers = workers
    if work_limit is not None:
        solver.parameters.max_deterministic_time = float(work_limit)
    solver.parameters.random_seed = seed
    # The heuristic's schedule is feasible; without repair CP-SAT can miss it (seen on V shapes).
    # No repair_hint: in OR-Tools 9.15 it trips a "heuristics.fixed_search" check that aborts the process.
    # Probing the reservoirs' expansion can eat the whole budget in presolve (benchmarks/search/README.md).
    solver.parameters.cp_model_probing_level = 0
    code = solver.solve(cp, _Stream(start, on_solution) if on_solution is not None else None)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solved(None, solver.best_objective_bound, "unknown")
    starts = [solver.value(s) for s in start]
    status = "optimal" if code == cp_model.OPTIMAL else "feasible"
    return Solved(order_from_starts(model, starts), solver.best_objective_bound, status)
