"""Activation offload per part chosen jointly with the zero-bubble schedule under a memory limit.

Offloading a part (``schedule.levers``: its saved activations to host memory
after F, back before I) frees the memory of its microbatches in flight, so its
rank may warm up deeper (fewer bubbles), at the price of a copy of its M_a at
the host bandwidth added to its F and its I (``Problem.offload``). Under the
schedules the search builds the ranks early in the pipeline hold the most
microbatches, so the candidates are the prefixes of ranks (offload the parts of
the first k ranks) and, in a V, of parts (its first k chunks); the best of them is then changed one part
at a time while that shortens the step (in a V the best sets are less regular):
a few D heuristic runs instead of the 2^(parts) sets. The heuristic
(``autoschedule.heuristic``) schedules each set; the schedule is then simulated with
its memory actions (``sim.levers.simulate_levers``), and the shortest step whose
simulated peaks stay within the limit wins, the fewer offloaded parts on a tie. tests/autoschedule/test_offload.py compares it with every set on small cases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeweave.autoschedule.build import simulated_metrics, to_schedule
from pipeweave.autoschedule.heuristic import Result, heuristic, one_at_a_time
from pipeweave.autoschedule.problem import MEMORY_EPS, Problem
from pipeweave.schedule.ir import ScheduleError
from pipeweave.sim.cost import CostModel


def candidates(problem: Problem) -> list[frozenset[int]]:
    """The offload sets tried first: the parts of the first k ranks (k = 0..D), and in a V the first k
    parts of the model (the early chunks, which hold the most microbatches).

    Example:
        >>> from pipeweave.autoschedule.problem import problem_from_times
        >>> [sorted(c) for c in candidates(problem_from_times(3, 6))]
        [[], [0], [0, 1], [0, 1, 2]]
    """
    rank_of, n = problem.placement.stage_rank, problem.num_parts
    by_rank = [frozenset(p for p in range(n) if rank_of[p] < k) for k in range(problem.num_ranks + 1)]
    by_part = [frozenset(range(k)) for k in range(n + 1)]
    return list(dict.fromkeys(by_rank + by_part))


def offloaded_step(problem: Problem, parts: frozenset[int], **budget: Any) -> tuple[float, Result] | None:
    """The heuristic's schedule with ``parts`` offloaded: its simulated max span (copies and memory actions
    included), or None when one microbatch per rank does not fit with these parts or the schedule's
    simulated peaks exceed the limit; ``budget``: the heuristic's options."""
    try:
        instance = dataclasses.replace(problem, offload=parts)
    except ScheduleError:
        return None
    return _checked(instance, heuristic(instance, **budget))


def _checked(instance: Problem, result: Result) -> tuple[float, Result] | None:
    metrics = simulated_metrics(instance, to_schedule(instance, result.order, updates=False))
    if any(p > lim + MEMORY_EPS for p, lim in zip(metrics.peak_activations, instance.peak_limit)):
        return None
    return max(metrics.span), result


def choose_offload(problem: Problem, **budget: Any) -> tuple[frozenset[int], Result]:
    """The offload set of shortest simulated step within the limit, and its schedule: the best of
    ``candidates``, then changed one part at a time while that shortens the step (a local search).
    ``problem``'s own offload is replaced by each set's (build it with every part offloaded: the least
    memory, see ``offload_problem``); one microbatch at a time with every part offloaded is the fallback
    that always fits."""
    tried: dict[frozenset[int], tuple[float, Result] | None] = {}

    def step(parts: frozenset[int]) -> tuple[float, Result] | None:
        if parts not in tried:
            tried[parts] = offloaded_step(problem, parts, **budget)
        return tried[parts]

    best: tuple[float, frozenset[int]] | None = None
    for parts in candidates(problem):
        found = step(parts)
        if found is not None and (best is None or found[0] < best[0] * (1 - 1e-9)):
            best = found[0], parts
    while best is not None:
        changed = [
            (found[0], parts)
            for parts in (best[1] ^ {p} for p in range(problem.num_parts))
            if (found := step(parts)) is not None and found[0] < best[0] * (1 - 1e-9)
        ]
        if not changed:
            break
        best = min(changed, key=lambda c: (c[0], len(c[1])))
    if best is None:
        return problem.offload, one_at_a_time(problem)
    found = tried[best[1]]
    assert found is not None
    return best[1], found[1]


def offload_problem(
    num_stages: int,
    num_microbatches: int,
    *,
    vshape: bool,
    cost: CostModel,
    activation_limit: float,
    host_bandwidth: float,
) -> Problem:
    """The instance with every part offloaded, for ``choose_offload``.

    Raises:
        ScheduleError: the limit is below what any offload reaches; it names the least that is (every part
            offloaded: a rank holds one microbatch of one part at a time).
    """
    options: dict[str, Any] = {
        "num_stages": num_stages,
        "num_microbatches": num_microbatches,
        "vshape": vshape,
        "cost": cost,
        "host_bandwidth": host_bandwidth,
    }
    parts = Problem(**options, activation_limit=float("inf")).num_parts
    try:
        return Problem(**options, activation_limit=activation_limit, offload=frozenset(range(parts)))
    except ScheduleError as error:
        least = str(error).rsplit(">= ", 1)[-1]
        raise ScheduleError(
            f"--activation-limit {activation_limit:g} is below what any offload reaches; the smallest "
            f"reachable is K={least} (every part offloaded)"
        ) from None
