"""The exact search's model (after the ILP of Qi et al., ICLR 2024, appendix G), shared by both back-ends.

The instance in integer units: one start time per F, I and W; the dependencies
of the IR with a hop of communication between ranks; no two actions of a rank
at once; and the memory limit on each rank's running sum (+M_a at an F's
start, -(1 - M_W/M_a) M_a at an I's end, -M_W at a W's end). Each stage runs
its F, its I and its W in microbatch order (the symmetry cut of ``exact.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeweave.autoschedule.problem import Problem
from pipeweave.schedule.ir import Action, Op


def _integer_scale(values: list[float], top: float = 1e7) -> tuple[float, bool]:
    """The least power of ten making every value integral (True), else an approximate one."""
    for k in range(7):
        scale = 10.0**k
        if max(values, default=0.0) * scale > top:
            break
        if all(abs(v * scale - round(v * scale)) < 1e-6 for v in values):
            return scale, True
    biggest = max(values, default=1.0) or 1.0
    return 1e5 / biggest, False


@dataclass
class Model:
    """The instance in integer units, shared by both back-ends.

    Attributes:
        actions: every F, I, W; ``index`` maps each to its position.
        duration, release: per action, integer duration and earliest start.
        preds: per action, (predecessor, lag): start >= start(pred) + lag.
        rank_of: per action, its rank; ``rank_actions`` per rank.
        delta: per action, its change of the rank's memory (F +, I and W -).
        limit: per rank, the memory limit; ``start`` per rank, S_r.
        horizon: an upper bound on every end time (from the incumbent).
        exact: the integer units are the instance's exactly (the solver bound is proven).
    """

    problem: Problem
    time_scale: float
    actions: list[Action]
    index: dict[Action, int]
    duration: list[int]
    release: list[int]
    preds: list[list[tuple[int, int]]]
    rank_of: list[int]
    rank_actions: list[list[int]]
    delta: list[int]
    limit: list[int]
    start: list[int]
    horizon: int
    exact: bool

    def delta_sign(self, i: int) -> int:
        """+1 for an F (memory grows at its start), -1 for I and W (shrinks at their end)."""
        return 1 if self.actions[i].op is Op.F else -1

    def delta_signed(self, i: int) -> int:
        return self.delta_sign(i) * self.delta[i]


def build_model(problem: Problem, incumbent_span: float) -> Model:
    """Scale times and memory to integers and list precedences (see the module docstring)."""
    c, place = problem.costs, problem.placement
    t_scale, t_exact = _integer_scale(list(c.f) + list(c.b) + list(c.w) + [c.comm])
    mem = [x for s in range(problem.num_parts) for x in (c.activation[s], c.activation[s] * c.mem_w)]
    m_scale, m_exact = _integer_scale(mem + list(problem.limit))
    actions = [a for r in range(problem.num_ranks) for a in problem.actions_on(r)]
    index = {a: i for i, a in enumerate(actions)}
    hop = round(c.comm * t_scale)

    def dur(a: Action) -> int:
        return round(problem.duration(a.stage, a.op) * t_scale)

    def delta(a: Action) -> int:
        size = c.activation[a.stage] * m_scale
        if a.op is Op.F:  # rounding is conservative: grow up, shrink down
            return math.ceil(size - 1e-9)
        part = size * (1 - c.mem_w) if a.op is Op.I else size * c.mem_w
        return math.floor(part + 1e-9)

    preds: list[list[tuple[int, int]]] = [[] for _ in actions]
    for i, (s, op, j) in enumerate(actions):

        def after(other: Action, lag: int) -> None:
            preds[i].append((index[other], lag))

        if j > 0:
            after(Action(s, op, j - 1), dur(Action(s, op, j - 1)))
        if op is Op.F and place.prev_stage(s) is not None:
            prev = place.prev_stage(s)
            assert prev is not None
            after(Action(prev, Op.F, j), dur(Action(prev, Op.F, j)) + (hop if problem.hop(prev, s) else 0))
        elif op is Op.I:
            after(Action(s, Op.F, j), dur(Action(s, Op.F, j)))
            nxt = place.next_stage(s)
            if nxt is not None:
                after(Action(nxt, Op.I, j), dur(Action(nxt, Op.I, j)) + (hop if problem.hop(nxt, s) else 0))
        elif op is Op.W:
            after(Action(s, Op.I, j), dur(Action(s, Op.I, j)))
    rank_of = [problem.rank_of(a.stage) for a in actions]
    rank_actions = [[i for i in range(len(actions)) if rank_of[i] == r] for r in range(problem.num_ranks)]
    starts = [round(x * t_scale) for x in problem.start_offset]
    release = _release(actions, preds, [dur(a) for a in actions])
    horizon = max(starts) + math.ceil(incumbent_span * t_scale) + 1
    return Model(
        problem,
        t_scale,
        actions,
        index,
        [dur(a) for a in actions],
        release,
        preds,
        rank_of,
        rank_actions,
        [delta(a) for a in actions],
        [math.floor(x * m_scale + 1e-6) for x in problem.limit],
        starts,
        horizon,
        t_exact and m_exact,
    )


def _release(actions: list[Action], preds: list[list[tuple[int, int]]], duration: list[int]) -> list[int]:
    """Earliest starts over the precedences alone (a longest path, by relaxation)."""
    release = [0] * len(actions)
    order = sorted(range(len(actions)), key=lambda i: _topo_key(actions[i]))
    for i in order:
        for p, lag in preds[i]:
            release[i] = max(release[i], release[p] + lag)
    return release


def _topo_key(a: Action) -> tuple[int, int, int]:
    # F by microbatch then stage; I after every F of its microbatch, deepest stage first; W after I.
    if a.op is Op.F:
        return (a.microbatch, 0, a.stage)
    if a.op is Op.I:
        return (a.microbatch, 1, -a.stage)
    return (a.microbatch, 2, a.stage)


def incumbent_starts(model: Model, order: list[list[Action]]) -> list[int]:
    """Integer ASAP start of every action under a given order (the warm start)."""
    start = [0] * len(model.actions)
    pending = [list(row) for row in order]
    clock = [0] * len(pending)
    done = [False] * len(model.actions)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(pending):
            while row:
                i = model.index[row[0]]
                if not all(done[p] for p, _ in model.preds[i]):
                    break
                start[i] = max([clock[r]] + [start[p] + lag for p, lag in model.preds[i]])
                clock[r] = start[i] + model.duration[i]
                done[i] = True
                row.pop(0)
                progress = True
    return start


def order_from_starts(model: Model, starts: list[int]) -> list[list[Action]]:
    """Per rank, its actions sorted by start (ties: shorter first, then dependency order)."""
    rows: list[list[Action]] = []
    for r in range(model.problem.num_ranks):
        idx = sorted(
            model.rank_actions[r], key=lambda i: (starts[i], starts[i] + model.duration[i], _topo_key(model.actions[i]))
        )
        rows.append([model.actions[i] for i in idx])
    return rows


@dataclass
class Solved:
    """What a back-end returns: an order (or None), the proven bound and status."""

    order: list[list[Action]] | None
    bound: float  # in integer units; -inf when none
    status: str
