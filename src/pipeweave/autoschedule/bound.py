"""A lower bound on the max span of any schedule of a zero-bubble instance, by hand.

Computed without any solver, so every searched schedule carries an independent
optimality gap. For each rank r (its first action can start no earlier than
S_r, the forward chain before it) the span is its work plus its idle time, and
two windows force idleness:

- start: until the first gradient can reach the rank (its first I at t_I, after
  the forward and backward chains below it), the rank can only run F, and
  memory caps how many: idle >= (t_I - S_r) - (F time that fits in the limit);
- end: after its last F ends (t_F), the microbatch of that F still needs the
  chains below it plus its own I and W, while the rank can only run the I and W
  of what it holds at t_F, which memory caps: idle >= tail - (that work).

The windows are disjoint when the rank cannot hold all its microbatches at
once (some I must then precede the last F); otherwise the larger one counts.
"""

from __future__ import annotations

import dataclasses
import math

from pipeweave.autoschedule.problem import MEMORY_EPS, Problem


def lower_bound(problem: Problem) -> float:
    """The largest per-rank bound: no schedule's max span is below it.

    Example:
        >>> from pipeweave.autoschedule.problem import problem_from_times
        >>> lower_bound(problem_from_times(4, 8, activation_limit=2))  # ZB-H2 reaches it
        24.0
    """
    if problem.offload:  # offloaded stages hold memory only while they run: bounded by time alone (weaker, valid)
        problem = dataclasses.replace(problem, activation_limit=math.inf)
    return max(rank_bounds(problem))


def rank_bounds(problem: Problem) -> list[float]:
    """Per rank, a lower bound on that rank's span."""
    return [_rank_bound(problem, r) for r in range(problem.num_ranks)]


def chain_below(problem: Problem, stage: int) -> float:
    """Time from the end of F(stage, j) to the earliest start of I(stage, j).

    The forward of every later stage, then their I in reverse, with a hop per
    change of rank each way.
    """
    place, costs = problem.placement, problem.costs
    total, s = 0.0, stage
    nxt = place.next_stage(s)
    while nxt is not None:
        total += 2 * problem.hop(s, nxt) + costs.f[nxt] + costs.b[nxt]
        s, nxt = nxt, place.next_stage(nxt)
    return total


def _rank_bound(problem: Problem, rank: int) -> float:
    stages = problem.stages_on(rank)
    costs, limit, t = problem.costs, problem.limit[rank], problem.num_microbatches
    start = problem.start_offset[rank]
    first_i = min(_f_end(problem, s) + chain_below(problem, s) for s in stages)
    idle_start = max(0.0, first_i - start - _max_forward_time(problem, rank))
    tail = min(chain_below(problem, s) + costs.b[s] + costs.w[s] for s in stages)
    idle_end = max(0.0, tail - _max_pending_work(problem, rank))
    holds_all = sum(t * costs.activation[s] for s in stages) <= limit + MEMORY_EPS
    idle = max(idle_start, idle_end) if holds_all else idle_start + idle_end
    return problem.work(rank) + idle


def _f_end(problem: Problem, stage: int) -> float:
    """Earliest end of F(stage, 0): the forward chain up to and including it."""
    place, costs = problem.placement, problem.costs
    total, s = costs.f[stage], stage
    prev = place.prev_stage(s)
    while prev is not None:
        total += costs.f[prev] + problem.hop(prev, s)
        s, prev = prev, place.prev_stage(prev)
    return total


def _max_forward_time(problem: Problem, rank: int) -> float:
    """Most F time a rank can run holding at most its limit (fractional knapsack)."""
    costs, room, t = problem.costs, problem.limit[rank] + MEMORY_EPS, problem.num_microbatches
    items = sorted(
        ((costs.f[s], costs.activation[s]) for s in problem.stages_on(rank)),
        key=lambda fa: -fa[0] / fa[1] if fa[1] > 0 else -math.inf,
    )
    total = 0.0
    for f, a in items:
        count = t if a <= 0 else min(t, room / a)
        total += count * f
        room -= count * a
    return total


def _max_pending_work(problem: Problem, rank: int) -> float:
    """Most I and W time the microbatches a rank holds within its limit can still need."""
    stages = problem.stages_on(rank)
    costs, t, m = problem.costs, problem.num_microbatches, problem.costs.mem_w
    limit = problem.limit[rank] + MEMORY_EPS
    if len(stages) == 1:
        s = stages[0]
        return _pending_one_stage(costs.b[s], costs.w[s], costs.activation[s], m, limit, t)
    # Several stages: every stage at its best work per unit of memory (looser, still sound).
    everything = sum(t * (costs.b[s] + costs.w[s]) for s in stages)
    ratios = []
    for s in stages:
        a = costs.activation[s]
        if a <= 0 or (m <= 0 and costs.w[s] > 0):
            return everything
        ratios.append(max((costs.b[s] + costs.w[s]) / a, costs.w[s] / (m * a) if m > 0 else 0.0))
    return min(everything, limit * max(ratios))


def _pending_one_stage(b: float, w: float, a: float, m: float, limit: float, t: int) -> float:
    """max x b + y w over 0 <= x <= y <= t with (1-m) a x + m a y <= limit (an LP's vertices).

    x counts microbatches whose I is pending (holding a), y those whose W is.
    """
    if a <= 0:
        return t * (b + w)
    cap = limit / a
    vertices = [(0.0, 0.0), (min(t, cap), min(t, cap))]
    if m > 0:
        vertices.append((0.0, min(t, cap / m)))
    if m < 1:
        x = (cap - m * t) / (1 - m)
        if 0 <= x <= t:
            vertices.append((x, float(t)))
    feasible = [(x, y) for x, y in vertices if (1 - m) * x + m * y <= cap + 1e-9 and x <= y + 1e-9 and y <= t]
    return max(x * b + y * w for x, y in feasible)


__all__ = ["chain_below", "lower_bound", "rank_bounds"]
