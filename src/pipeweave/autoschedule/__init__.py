"""Automatic zero-bubble scheduling under a memory limit: heuristic, exact search, proven bound (no torch).

Import only ``schedule.ir``/``validate``/``dataflow`` and ``sim`` from here, never
``schedule.registry``: the registry imports this package lazily, inside its
``zb-auto`` generators, so neither import cycle nor solver import happens at
``import pipeweave.schedule``.
"""

from pipeweave.autoschedule.bound import lower_bound, rank_bounds
from pipeweave.autoschedule.build import SearchResult, finish, to_schedule
from pipeweave.autoschedule.exact import DEFAULT_SOLVER, SOLVERS, exact
from pipeweave.autoschedule.heuristic import Policy, heuristic, list_schedule
from pipeweave.autoschedule.problem import Problem, problem_from_times

__all__ = [
    "DEFAULT_SOLVER",
    "Policy",
    "Problem",
    "SOLVERS",
    "SearchResult",
    "exact",
    "finish",
    "heuristic",
    "list_schedule",
    "lower_bound",
    "problem_from_times",
    "rank_bounds",
    "to_schedule",
]
