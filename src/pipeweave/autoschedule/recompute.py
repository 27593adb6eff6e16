"""Recomputation per part chosen jointly with the zero-bubble schedule under a memory limit.

Recomputing a part keeps fewer bytes per microbatch in flight (more fit under
the limit, so fewer bubbles) at the price of a replayed forward before each of
its backwards (``sim.cost.CostModel.recompute``). Under the schedules the
search builds, the ranks early in the pipeline hold the most microbatches, so
the candidates are the assignments that recompute no less on a rank than on
any later one: every split of the ranks into three groups, in order, doing
``full``, ``selective`` and ``none`` (any group may be empty) -- (D + 1)(D + 2) / 2
of them instead of the 3^(parts) assignments. (Two groups were enough while
the simulator left the replay out of the peak; with a full replay held during
its backward, ``full, full, selective, none`` is the best at D = 4 in the
test's case.) The heuristic
(``autoschedule.heuristic``) schedules each; the shortest step wins, the fewer
recomputing parts on a tie. tests/autoschedule/test_recompute.py compares it with
every assignment on small cases.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipeweave.autoschedule.heuristic import Result, heuristic
from pipeweave.autoschedule.problem import Problem
from pipeweave.schedule.ir import ScheduleError
from pipeweave.sim.cost import CostModel


def candidates(problem: Problem) -> list[tuple[str, ...]]:
    """The assignments tried: per part, by its rank's position (see the module docstring), none first.

    Example:
        >>> from pipeweave.autoschedule.problem import problem_from_times
        >>> candidates(problem_from_times(2, 4))  # doctest: +NORMALIZE_WHITESPACE
        [('none', 'none'), ('selective', 'none'), ('full', 'none'), ('selective', 'selective'), ('full', 'selective'),
         ('full', 'full')]
    """
    rank_of, d = problem.placement.stage_rank, problem.num_ranks
    found: list[tuple[str, ...]] = []
    for full in range(d + 1):  # ranks below ``full`` recompute in full, below ``recomputing`` selective
        for recomputing in range(full, d + 1):
            modes = tuple(
                "full" if rank_of[part] < full else "selective" if rank_of[part] < recomputing else "none"
                for part in range(problem.num_parts)
            )
            if modes not in found:
                found.append(modes)
    return sorted(found, key=lambda m: sum(x != "none" for x in m))


def with_recompute(problem: Problem, modes: tuple[str, ...]) -> Problem:
    """``problem`` with its parts recomputing ``modes`` (its limit in bytes unchanged).

    Raises:
        ScheduleError: one microbatch per rank no longer fits the limit.
    """
    return dataclasses.replace(problem, cost=dataclasses.replace(problem.cost, recompute=modes))


def choose_recompute(problem: Problem, **budget: Any) -> tuple[tuple[str, ...], Result]:
    """The assignment of ``candidates`` whose heuristic schedule has the shortest step, and that schedule.

    ``problem``'s own recomputation is replaced by each candidate's (build it with every part in
    ``full``: the least memory, see ``recompute_problem``); ``budget``: the heuristic's options.
    """
    best: tuple[tuple[str, ...], Result] | None = None
    for modes in candidates(problem):
        try:
            instance = with_recompute(problem, modes)
        except ScheduleError:  # one microbatch per rank does not fit with these modes
            continue
        result = heuristic(instance, **budget)
        if best is None or result.span < best[1].span * (1 - 1e-9):
            best = modes, result
    assert best is not None, "every part in full fits: recompute_problem checked it"
    return best


def recompute_problem(
    num_stages: int, num_microbatches: int, *, vshape: bool, cost: CostModel, activation_limit: float
) -> Problem:
    """The instance with every part recomputing in full, for ``choose_recompute``.

    Raises:
        ScheduleError: the limit is below what any recomputation reaches; it names the least that is.
    """
    full = dataclasses.replace(cost, recompute="full")
    try:
        return Problem(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            vshape=vshape,
            cost=full,
            activation_limit=activation_limit,
        )
    except ScheduleError:
        loose = Problem(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            vshape=vshape,
            cost=full,
            activation_limit=math.inf,
        )
        plain = dataclasses.replace(cost, recompute="none").for_parts(num_parts=loose.num_parts, num_ranks=num_stages)
        replayed = loose.costs.replayed  # one backward's replay on top (``Problem.limit``)
        held = [
            (
                sum(loose.costs.activation[s] for s in loose.stages_on(r))
                + max(replayed[s] for s in loose.stages_on(r)),
                sum(plain.activation[s] for s in loose.stages_on(r)),
            )
            for r in range(num_stages)
        ]
        least = max((m / (num_stages * p) for m, p in held if p > 0), default=0.0)
        raise ScheduleError(
            f"--activation-limit {activation_limit:g} is below what any recomputation reaches; the "
            f"smallest reachable is K={least:.4g} (every part recomputing in full)"
        ) from None
