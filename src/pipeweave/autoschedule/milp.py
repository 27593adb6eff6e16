"""The exact search as a MILP on HiGHS, after the zero-bubble paper's ILP (Qi et al., ICLR 2024, app. G).

Start times are continuous; a binary per pair of actions of a rank whose order
the dependencies leave open says which goes first (big-M disjunctions, M the
incumbent's horizon); the memory limit is checked at every F's start, from
those same binaries.
"""

from __future__ import annotations

import math

import highspy
import numpy as np

from pipeweave.autoschedule.exact_model import Model, Solved, order_from_starts
from pipeweave.schedule.ir import Op


def _ancestors(model: Model) -> list[int]:
    """Per action, a bitset of every action that must precede it (transitively)."""
    from pipeweave.autoschedule.exact_model import _topo_key

    anc = [0] * len(model.actions)
    for i in sorted(range(len(model.actions)), key=lambda i: _topo_key(model.actions[i])):
        for p, _ in model.preds[i]:
            anc[i] |= anc[p] | (1 << p)
    return anc


class _Rows:
    """Constraint rows lower <= sum(coef x) <= upper, collected for one addRows call."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.starts: list[int] = []
        self.index: list[int] = []
        self.value: list[float] = []

    def add(self, terms: dict[int, float], lower: float, upper: float) -> None:
        self.starts.append(len(self.index))
        self.index += list(terms)
        self.value += list(terms.values())
        self.lower.append(lower)
        self.upper.append(upper)


def solve_milp(model: Model, warm: list[int], time_limit: float, workers: int) -> Solved:
    """Minimise the max span of ``model`` with HiGHS's branch and cut, from the ``warm`` starts.

    Run it through ``exact.exact`` (or ``exact.solve_isolated``): this solver's
    library must not share a process with the other one's.

    Example:
        >>> from pipeweave.autoschedule.exact import exact
        >>> from pipeweave.autoschedule.problem import Problem
        >>> exact(Problem(num_stages=2, num_microbatches=2), solver="highs", time_limit=5).status
        'optimal'
    """
    n, big = len(model.actions), float(model.horizon)
    anc = _ancestors(model)
    pairs = [
        (i, k)
        for members in model.rank_actions
        for a, i in enumerate(members)
        for k in members[a + 1 :]
        if not (anc[i] >> k) & 1 and not (anc[k] >> i) & 1
    ]
    span_col, z0 = n, n + 1
    pair_col = {pair: z0 + q for q, pair in enumerate(pairs)}
    rows = _Rows()
    for i in range(n):
        for p, lag in model.preds[i]:
            rows.add({i: 1.0, p: -1.0}, lag, math.inf)
    for (i, k), col in pair_col.items():  # z = 1: i before k
        rows.add({k: 1.0, i: -1.0, col: -big}, model.duration[i] - big, math.inf)
        rows.add({i: 1.0, k: -1.0, col: big}, model.duration[k], math.inf)
    for i, a in enumerate(model.actions):
        if a.op is Op.W and a.microbatch == model.problem.num_microbatches - 1:
            rows.add({span_col: 1.0, i: -1.0}, model.duration[i] - model.start[model.rank_of[i]], math.inf)
    for r, members in enumerate(model.rank_actions):
        _memory_rows(model, rows, r, members, anc, pair_col)
    h = highspy.Highs()  # type: ignore[no-untyped-call]
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    if workers:
        h.setOptionValue("threads", int(workers))
    lower = [float(model.release[i]) for i in range(n)] + [0.0] + [0.0] * len(pairs)
    upper = [float(model.horizon - model.duration[i]) for i in range(n)] + [big] + [1.0] * len(pairs)
    h.addVars(len(lower), np.array(lower), np.array(upper))
    h.changeColCost(span_col, 1.0)
    if pairs:
        cols = np.arange(z0, z0 + len(pairs), dtype=np.int32)
        h.changeColsIntegrality(len(pairs), cols, np.array([highspy.HighsVarType.kInteger] * len(pairs)))
    h.addRows(
        len(rows.lower),
        np.array(rows.lower),
        np.array(rows.upper),
        len(rows.index),
        np.array(rows.starts, dtype=np.int32),
        np.array(rows.index, dtype=np.int32),
        np.array(rows.value),
    )
    _warm_start(h, model, warm, pairs)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if info.primal_solution_status != 2:  # no feasible point
        return Solved(None, -math.inf, "unknown")
    values = list(h.getSolution().col_value)
    starts = [round(v) for v in values[:n]]
    word = "optimal" if status == highspy.HighsModelStatus.kOptimal else "feasible"
    return Solved(order_from_starts(model, starts), float(info.mip_dual_bound), word)


def _memory_rows(
    model: Model, rows: _Rows, rank: int, members: list[int], anc: list[int], pair_col: dict[tuple[int, int], int]
) -> None:
    """At each F's start, what the rank holds is within its limit."""
    for f in members:
        if model.delta_sign(f) < 0:
            continue
        terms: dict[int, float] = {}
        constant = float(model.delta[f])
        for g in members:
            if g == f:
                continue
            change = float(model.delta_signed(g))
            if (anc[f] >> g) & 1:
                constant += change  # g surely before f
            elif not (anc[g] >> f) & 1:  # open: before(g, f) is z or 1 - z
                if (g, f) in pair_col:
                    terms[pair_col[g, f]] = terms.get(pair_col[g, f], 0.0) + change
                else:
                    col = pair_col[f, g]
                    terms[col] = terms.get(col, 0.0) - change
                    constant += change
        rows.add(terms, -math.inf, model.limit[rank] - constant)


def _warm_start(h: highspy.Highs, model: Model, warm: list[int], pairs: list[tuple[int, int]]) -> None:
    n = len(model.actions)
    span = max(warm[i] + model.duration[i] - model.start[model.rank_of[i]] for i in range(n))
    before = [
        1.0 if (warm[i], warm[i] + model.duration[i]) <= (warm[k], warm[k] + model.duration[k]) else 0.0
        for i, k in pairs
    ]
    solution = highspy.HighsSolution()
    solution.col_value = [float(x) for x in warm] + [float(span)] + before
    solution.value_valid = True
    h.setSolution(solution)
