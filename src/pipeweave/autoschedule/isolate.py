"""Run one exact back-end in a child process under a hard deadline, keeping its best-so-far.

OR-Tools and highspy each ship their own ``libhighs.so.1`` (different
versions, one soname): whichever loads second fails to link, so the two
solvers cannot share a process. A child process per search also lets a hard
deadline stop a solver that overruns its own time limit (CP-SAT's presolve of
a large model does), and the child streams every improving solution it finds,
so stopping it loses nothing that was found.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any

from pipeweave.autoschedule.exact_model import Model, Solved, order_from_starts

# Part of the remaining time left to the parent: receiving, checking, and the child's start.
_MARGIN = 0.1


@dataclass(frozen=True)
class Budget:
    """How long a back-end may search.

    Attributes:
        deadline: ``time.perf_counter()`` value at which the child is stopped.
        workers: solver threads (0: the solver's default).
        work_limit: CP-SAT's deterministic time in its own seconds (None: none); with
            one worker the search is then reproducible, whatever the machine's load.
        seed: CP-SAT's random seed.
    """

    deadline: float
    workers: int = 0
    work_limit: float | None = None
    seed: int = 0


def solve_isolated(solver: str, model: Model, warm: list[int], budget: Budget) -> Solved:
    """Solve in a fresh process; at the deadline, stop it and return what it had found.

    Example:
        >>> from pipeweave.autoschedule.exact_model import build_model
        >>> from pipeweave.autoschedule.heuristic import heuristic
        >>> from pipeweave.autoschedule.problem import Problem
        >>> p = Problem(num_stages=2, num_microbatches=2)
        >>> m = build_model(p, heuristic(p).span)
        >>> solve_isolated("cpsat", m, [0] * len(m.actions), Budget(time.perf_counter() + 20)).status
        'optimal'
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    limit = max(0.1, (budget.deadline - time.perf_counter()) * (1 - _MARGIN))
    child = context.Process(target=_child, args=(sender, solver, model, warm, limit, budget), daemon=True)
    child.start()
    sender.close()
    latest: list[int] | None = None
    try:
        while True:
            left = budget.deadline - time.perf_counter()
            # A solver that aborts (a failed internal check) closes the pipe: EOFError, no hang.
            if left <= 0 or not receiver.poll(left):
                return _stopped(model, latest, "stopped")
            kind, payload = receiver.recv()
            if kind == "done":
                solved: Solved = payload
                return solved
            latest = payload
    except EOFError:
        return _stopped(model, latest, "solver crashed")
    finally:
        child.join(timeout=0.5)
        if child.is_alive():
            child.kill()
            child.join(timeout=5)


def _stopped(model: Model, latest: list[int] | None, status: str) -> Solved:
    order = None if latest is None else order_from_starts(model, latest)
    return Solved(order, -math.inf, status)


def _child(sender: Any, solver: str, model: Model, warm: list[int], limit: float, budget: Budget) -> None:
    def report(starts: list[int]) -> None:
        sender.send(("incumbent", starts))

    if solver == "cpsat":
        from pipeweave.autoschedule.cpsat import solve_cpsat

        solved = solve_cpsat(
            model, warm, limit, budget.workers, work_limit=budget.work_limit, seed=budget.seed, on_solution=report
        )
    else:
        from pipeweave.autoschedule.milp import solve_milp

        solved = solve_milp(model, warm, limit, budget.workers)
    sender.send(("done", solved))
    sender.close()


__all__ = ["Budget", "solve_isolated"]
