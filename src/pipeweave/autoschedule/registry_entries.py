"""The registry's automatic zero-bubble schedules (Qi et al., ICLR 2024): ``zb-auto`` and ``zb-v-auto``.

The generators plan for the costs given as options (in ``pipeweave train``
they come from profiling the first steps); the schedule is valid under any
costs, only its quality depends on them.
"""

from __future__ import annotations

from pipeweave.autoschedule.exact import exact
from pipeweave.autoschedule.problem import Problem
from pipeweave.schedule.ir import Schedule
from pipeweave.sim.cost import CostModel, Value


def plan(
    num_stages: int,
    num_microbatches: int,
    *,
    vshape: bool,
    activation_limit: float,
    mem_w: float,
    time_f: Value,
    time_b: Value,
    time_w: Value,
    time_comm: float,
    solver: str,
    time_limit: float,
) -> Schedule:
    """The searched schedule of one instance (see ``zb_auto``)."""
    cost = CostModel(f=time_f, b=time_b, w=time_w, comm=time_comm, mem_w=mem_w)
    problem = Problem(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        vshape=vshape,
        cost=cost,
        activation_limit=activation_limit,
    )
    # Every rank of a run builds its schedule itself, so they must agree: one worker and a
    # deterministic work limit make CP-SAT's result independent of the clock; the wall limit
    # (10 x) only guards a machine so slow that the work limit cannot bind first.
    return exact(problem, solver=solver, time_limit=10 * time_limit, workers=1, work_limit=time_limit).schedule


def zb_auto(
    num_stages: int,
    num_microbatches: int,
    *,
    activation_limit: float = 1.0,
    mem_w: float = 0.5,
    time_f: Value = 1.0,
    time_b: Value = 1.0,
    time_w: Value = 1.0,
    time_comm: float = 0.0,
    solver: str = "heuristic",
    time_limit: float = 10.0,
) -> Schedule:
    """Automatic zero bubble on D straight stages under a memory limit.

    Args:
        num_stages: D.
        num_microbatches: T.
        activation_limit: K, the per-rank activation limit as a multiple of 1F1B's
            peak D x M_a: 1 for ZB-1p, 2 for ZB-2p.
        mem_w: M_W / M_a, the activation still held between I and W (paper: 0.5).
        time_f, time_b, time_w, time_comm: the costs to plan for (b is I's time).
        solver: "heuristic" (fast, deterministic; the default), "cpsat" or "highs".
        time_limit: work for an exact solver: CP-SAT's deterministic seconds (about
            wall seconds on an idle core), so every rank builds the same schedule;
            HiGHS (single-threaded) stops at 10 x this many wall seconds.

    Raises:
        ScheduleError: a limit below one microbatch per rank, or an unknown solver.

    Example:
        >>> s = zb_auto(4, 8, activation_limit=2)
        >>> [str(a) for a in s.actions[3][:4]]
        ['3F0', '3I0', '3F1', '3I1']
    """
    return plan(
        num_stages,
        num_microbatches,
        vshape=False,
        activation_limit=activation_limit,
        mem_w=mem_w,
        time_f=time_f,
        time_b=time_b,
        time_w=time_w,
        time_comm=time_comm,
        solver=solver,
        time_limit=time_limit,
    )


def zb_v_auto(
    num_stages: int,
    num_microbatches: int,
    *,
    activation_limit: float = 1.0,
    mem_w: float = 0.5,
    time_f: Value = 1.0,
    time_b: Value = 1.0,
    time_w: Value = 1.0,
    time_comm: float = 0.0,
    solver: str = "heuristic",
    time_limit: float = 10.0,
) -> Schedule:
    """Automatic zero bubble on a V (2 chunks per rank, ZB-V's placement); options as ``zb_auto``.

    Example:
        >>> zb_v_auto(4, 8).placement.stage_rank
        (0, 1, 2, 3, 3, 2, 1, 0)
    """
    return plan(
        num_stages,
        num_microbatches,
        vshape=True,
        activation_limit=activation_limit,
        mem_w=mem_w,
        time_f=time_f,
        time_b=time_b,
        time_w=time_w,
        time_comm=time_comm,
        solver=solver,
        time_limit=time_limit,
    )
