"""From a searched order to a checked result: the IR schedule, its simulated metrics, its gap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeweave.autoschedule.problem import MEMORY_EPS, Problem
from pipeweave.schedule.ir import Action, Schedule, WeightPolicy, append_updates
from pipeweave.schedule.levers import StashPlan
from pipeweave.schedule.validate import InvalidSchedule, validate
from pipeweave.sim.levers import simulate_levers
from pipeweave.sim.metrics import Metrics, compute_metrics
from pipeweave.sim.timeline import simulate


def to_schedule(problem: Problem, order: list[list[Action]], *, name: str = "", updates: bool = True) -> Schedule:
    """The IR schedule of per-rank F/I/W orders, with each stage's U appended."""
    rows = [list(row) for row in order]
    if updates:
        append_updates(rows, problem.placement)
    label = name or ("zb-v-auto" if problem.vshape else "zb-auto")
    return Schedule(
        label, problem.placement, problem.num_microbatches, tuple(tuple(r) for r in rows), policy=WeightPolicy.SYNC
    )


@dataclass(frozen=True)
class SearchResult:
    """A searched schedule and everything known about its quality.

    Attributes:
        schedule: the schedule in the IR (validated).
        span: max over ranks of the rank's span, the objective (simulated).
        makespan: first start to last end (simulated).
        bubble_ratio: 1 - busy / (ranks x max span), DESIGN.md's definition.
        lower_bound: a proven lower bound on ``span`` for this instance.
        gap: (span - lower_bound) / span; 0 means proven optimal.
        solver: "heuristic", "cpsat" or "highs".
        solver_time: seconds spent (heuristic included).
        status: the solver's word ("optimal", "feasible", "heuristic", ...).
        metrics: all simulated metrics.
    """

    schedule: Schedule
    span: float
    makespan: float
    bubble_ratio: float
    lower_bound: float
    gap: float
    solver: str
    solver_time: float
    status: str
    metrics: Metrics = field(repr=False)

    @property
    def bubble_bound(self) -> float:
        """The least bubble ratio any schedule of this instance can have (from the bound)."""
        busy = sum(self.metrics.busy)
        n = self.schedule.num_ranks
        return 1.0 - busy / (n * self.lower_bound) if self.lower_bound > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.name,
            "stages": self.schedule.num_ranks,
            "microbatches": self.schedule.num_microbatches,
            "chunks": self.schedule.num_chunks,
            "span": self.span,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "lower_bound": self.lower_bound,
            "bubble_ratio_bound": self.bubble_bound,
            "gap": self.gap,
            "solver": self.solver,
            "solver_time": self.solver_time,
            "status": self.status,
            "peak_activations": list(self.metrics.peak_activations),
        }


def simulated_metrics(problem: Problem, schedule: Schedule) -> Metrics:
    """``schedule``'s simulated metrics under ``problem``'s costs, its offloaded parts' copies and peaks
    included (``sim.levers``)."""
    if not problem.offload:
        return compute_metrics(simulate(schedule, problem.cost, check=False))
    costs = problem.cost.for_parts(num_parts=problem.num_parts, num_ranks=problem.num_ranks)
    plan = StashPlan(offload=problem.offload)
    return simulate_levers(schedule, costs, plan, problem.host_bandwidth)[0]


def finish(
    problem: Problem,
    order: list[list[Action]],
    *,
    lower_bound: float,
    solver: str,
    solver_time: float,
    status: str,
    name: str = "",
) -> SearchResult:
    """Validate and simulate an order, check its memory, and attach bound and gap.

    Raises:
        InvalidSchedule: the order breaks a dependency or the memory limit (a search bug).
    """
    schedule = to_schedule(problem, order, name=name)
    validate(schedule)
    metrics = simulated_metrics(problem, schedule)
    over = [r for r, peak in enumerate(metrics.peak_activations) if peak > problem.peak_limit[r] + 1e-6]
    if over:
        r = over[0]
        raise InvalidSchedule(
            f"rank {r} holds {metrics.peak_activations[r]} of activations over its limit {problem.peak_limit[r]}",
            schedule,
            r,
        )
    span = max(metrics.span)
    bound = min(lower_bound, span)  # guards float noise; a real violation is caught by tests
    gap = (span - bound) / span if span > 0 else 0.0
    return SearchResult(
        schedule,
        span,
        metrics.makespan,
        metrics.bubble_ratio,
        bound,
        max(0.0, gap) if gap > 1e-9 else 0.0,
        solver,
        solver_time,
        status,
        metrics,
    )


__all__ = ["MEMORY_EPS", "SearchResult", "finish", "to_schedule"]
