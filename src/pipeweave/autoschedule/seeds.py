"""The registry's hand-built zero-bubble schedules as candidates of the heuristic: ZB-H1 and ZB-H2 on a
straight pipeline, ZB-V on a V (Qi et al., ICLR 2024, and its ZB-V follow-up).

The list scheduler (``autoschedule.heuristic``) builds its schedule greedily and can
miss what the hand-built ones do. At ZB-V's own memory (K = 1) on the
zero-bubble paper's large-model profile (f = b = 10.4, w = 7.7, comm 0.4 ms
per D-th of the model) its V bubble was 0.17-0.28 where ZB-V's is
0.07-0.08 (benchmarks/search/README.md). So each hand-built order is offered
too, under the instance's own memory limit (walked with
``sim.metrics.held_peaks``, the heuristic's own accounting: F holds M_a, I
keeps M_W of it, W frees that), and kept where it is strictly better.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pipeweave.autoschedule.problem import MEMORY_EPS, Problem
from pipeweave.schedule.ir import Action, Op, Schedule, ScheduleError
from pipeweave.schedule.zb_v import zb_v
from pipeweave.schedule.zero_bubble import zb_h1, zb_h2
from pipeweave.sim.metrics import held_peaks

SEEDS: dict[bool, tuple[Callable[[int, int], Schedule], ...]] = {False: (zb_h1, zb_h2), True: (zb_v,)}
"""Per placement (a V or not), the generators offered (the registry's, imported from their families: the
registry itself imports the search)."""


def seed_orders(problem: Problem) -> Iterator[list[list[Action]]]:
    """The per-rank F/I/W orders of the hand-built schedules that fit the instance (module docstring).

    Example:
        >>> from pipeweave.autoschedule.problem import problem_from_times
        >>> [len(o[0]) for o in seed_orders(problem_from_times(4, 8, activation_limit=2))]
        [24, 24]
    """
    for make in SEEDS[problem.vshape]:
        try:
            schedule = make(problem.num_stages, problem.num_microbatches)
        except ScheduleError:
            continue  # a size the family refuses
        if schedule.placement.stage_rank != problem.placement.stage_rank:
            continue
        order = [[a for a in row if a.op is not Op.U] for row in schedule.actions]
        if fits(problem, order):
            yield order


def fits(problem: Problem, order: list[list[Action]]) -> bool:
    """Whether every rank's activations stay within the instance's limit along ``order``."""
    held = problem.costs.activation
    stash = [a * problem.costs.mem_w for a in held]
    part_of = list(range(problem.placement.num_stages))  # the instance's costs are per stage
    peaks = held_peaks(order, part_of, held, stash)
    return all(p <= limit + MEMORY_EPS for p, limit in zip(peaks, problem.limit))
