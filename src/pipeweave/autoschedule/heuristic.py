"""The zero-bubble paper's constructive heuristic (Qi et al., ICLR 2024, section 3.1), searched.

A list scheduler walks time: a rank that is free runs, in priority order,
an ``I`` whose gradient has arrived (it unblocks the rank before it), an ``F``
whose input has arrived if the rank's in-flight count and memory allow it
(the warm-up goes as deep as its cap), else a pending ``W`` (weight gradients
fill what would be bubbles), else it waits. ``Policy`` holds the choices the
paper leaves open — warm-up depth per rank, how far W may lag, which chunk
goes first in a V — and ``heuristic`` tries a small grid of them, keeping the
schedule of least max span.

The warm-up depth is either a formula of the rank (1F1B's D - r, ZB-H2's
2D - 2r - 1, ...) or, as the paper computes it (section 3.1, "as many F as
the memory allows before the first B"), timed: per rank, how many F end
before the first gradient arrives from the rank after it, under the instance's
own costs and hops (``timed_depths``). With communication the timed depth
grows faster than any integer slope of the formula (each hop back adds its
time), which at D = 32 is what separates the two (benchmarks/search/README.md).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pipeweave.autoschedule.problem import MEMORY_EPS, Problem
from pipeweave.autoschedule.seeds import seed_orders
from pipeweave.schedule.ir import Action, Op

Order = list[list[Action]]


@dataclass(frozen=True)
class Policy:
    """The heuristic's open choices.

    Attributes:
        extra: warm-up depth beyond 1F1B's: rank r keeps at most
            ``base(r) + extra`` microbatches in flight (F done, I not).
        slope: how much deeper earlier ranks warm up: ``base(r) = D - r``
            plus ``slope x (D - 1 - r)`` (slope 1 is ZB-H2's 2D - 2r - 1 + 1).
        w_lag: pending W above which W runs before a new F (inf: only in gaps).
        deep_first: in a V, prefer the chunk further down the pipeline.
        f_first: an arrived F goes before an arrived I (keeps the forward
            wave at rank 0's pace; the memory and warm-up cap still apply).
        lookahead: when an I is known to arrive before an F or W would end,
            run only what fits in the gap, else wait for the I.
        look_f: the lookahead also waits for a known F arrival the rank may
            run (cap and memory): a W started just before it would delay the
            forward wave, and every later rank with it.
        balance: when the lookahead would leave a gap shorter than a W, run
            the W anyway if waiting would make this rank's idle time so far
            the largest of all ranks (the paper's rule for short gaps).
        timed: 0: the depth formula above; 1: ``timed_depths`` without an F that
            would still run when the first gradient arrives (a small bubble
            before the first I); 2: with one (no bubble, a later I); ``extra``
            adds to it. Straight placements only.
    """

    extra: int = 0
    slope: float = 0.0
    w_lag: float = math.inf
    deep_first: bool = True
    lookahead: bool = False
    f_first: bool = False
    look_f: bool = False
    balance: bool = False
    timed: int = 0


@dataclass
class Result:
    """A list schedule: per rank its actions in order, with start times."""

    order: Order
    starts: list[list[float]]
    span: float
    makespan: float


class _Rank:
    """Mutable state of one rank during the list schedule."""

    def __init__(self, problem: Problem, rank: int, policy: Policy, timed: int | None = None) -> None:
        d, t = problem.num_stages, problem.num_microbatches
        self.stages = sorted(problem.stages_on(rank), reverse=policy.deep_first)
        chunks = len(self.stages)
        depth = d - rank + round(policy.slope * (d - 1 - rank)) if timed is None else timed
        depth += policy.extra
        self.cap = max(chunks, min(t * chunks, depth * chunks))
        self.limit = problem.limit[rank] + MEMORY_EPS
        self.held = 0.0
        self.in_flight = 0
        self.pending_w = 0
        self.free_at = 0.0
        self.idle = 0.0  # waiting since the rank's first action
        self.peers: list[_Rank] = []
        self.durations = {s: {op: problem.duration(s, op) for op in (Op.F, Op.I, Op.W)} for s in self.stages}
        self.costs = problem.costs
        self.offload = problem.offload
        self.order: list[Action] = []
        self.starts: list[float] = []

    def start(self, action: Action, now: float) -> float:
        """Start ``action`` at ``now`` on this rank (its memory, counts, order, idle time); returns its end.

        F holds the microbatch's activations; I frees all but the share W needs (``mem_w``) and leaves
        a W pending; W frees that share. An offloaded stage (``Problem.offload``) holds nothing from F to I
        (its F's own M_a is checked by ``_forward``), and its I brings back the share W needs.
        """
        s, op, _ = action
        c = self.costs
        a = c.activation[s]
        away = s in self.offload
        if op is Op.F:
            end = now + c.f[s]
            self.held += 0.0 if away else a
            self.in_flight += 1
        elif op is Op.I:
            end = now + c.b[s]
            self.held += a * c.mem_w if away else -a * (1.0 - c.mem_w)
            self.in_flight -= 1
            self.pending_w += 1
        else:
            end = now + c.w[s]
            self.held -= a * c.mem_w
            self.pending_w -= 1
        if self.order:
            self.idle += now - self.free_at
        self.order.append(action)
        self.starts.append(now)
        self.free_at = end
        return end


def list_schedule(problem: Problem, policy: Policy) -> Result | None:
    """Run the list scheduler under one policy; None when it stalls (memory deadlock).

    Example:
        >>> r = list_schedule(Problem(num_stages=2, num_microbatches=2), Policy())
        >>> [str(a) for a in r.order[1]], r.span
        (['1F0', '1I0', '1F1', '1I1', '1W0', '1W1'], 7.0)
    """
    d, t = problem.num_stages, problem.num_microbatches
    c, place = problem.costs, problem.placement
    stages = place.num_stages
    timed = timed_depths(problem, overshoot=policy.timed == 2) if policy.timed and not problem.vshape else None
    ranks = [_Rank(problem, r, policy, None if timed is None else timed[r]) for r in range(d)]
    for rank in ranks:
        rank.peers = ranks
    f_ready = [[math.inf] * t for _ in range(stages)]  # input of F(s, j) available
    i_ready = [[math.inf] * t for _ in range(stages)]  # gradient of I(s, j) available
    f_ready[0] = [0.0] * t
    hop_next, hop_prev = _hops(problem)
    nf, ni, nw = [0] * stages, [0] * stages, [0] * stages  # next microbatch per op
    heap = [(0.0, r) for r in range(d)]
    done_count, total = 0, 3 * t * stages

    def post(ready: list[list[float]], s: int, j: int, at: float) -> None:
        ready[s][j] = at
        rank = ranks[place.stage_rank[s]]
        heapq.heappush(heap, (max(at, rank.free_at), place.stage_rank[s]))

    while heap:
        now, r = heapq.heappop(heap)
        rank = ranks[r]
        if now < rank.free_at:
            continue  # stale wake-up: the rank is busy
        action = _choose(rank, now, policy, nf, ni, nw, f_ready, i_ready, c.activation, t)
        if action is None:
            continue  # wait for an arrival
        s, op, j = action
        end = rank.start(action, now)
        done_count += 1
        if op is Op.F:  # what the action makes ready: the next F, or this stage's I after the last F
            nf[s] += 1
            nxt = place.next_stage(s)
            if nxt is None:
                post(i_ready, s, j, end)
            else:
                post(f_ready, nxt, j, end + hop_next[s])
        elif op is Op.I:  # the I of the stage before
            ni[s] += 1
            prev = place.prev_stage(s)
            if prev is not None:
                post(i_ready, prev, j, end + hop_prev[s])
        else:
            nw[s] += 1
        heapq.heappush(heap, (end, r))
    if done_count < total:
        return None
    return _result(problem, ranks)


def timed_depths(problem: Problem, *, overshoot: bool) -> list[int]:
    """Per rank of a straight pipeline, the microbatches it warms up with: its F of microbatch 0,
    then F's back to back while they end before microbatch 0's gradient arrives from the next
    rank (``overshoot``: while they start before it) and the memory limit allows; fewer on each
    later rank than on the one before (the paper's warm-up, section 3.1).

    Example:
        >>> from pipeweave.autoschedule.problem import problem_from_times
        >>> timed_depths(problem_from_times(4, 16, activation_limit=2), overshoot=False)
        [7, 5, 3, 1]
    """
    d, t, c = problem.num_stages, problem.num_microbatches, problem.costs
    f_end, at = [], 0.0
    for s in range(d):  # F of microbatch 0, down the pipeline
        at += (problem.hop(s - 1, s) if s else 0.0) + c.f[s]
        f_end.append(at)
    depths = [1] * d
    back = f_end[-1] + c.b[d - 1]  # end of the last rank's first I
    for s in range(d - 2, -1, -1):
        arrives = back + problem.hop(s + 1, s)
        clock, n = f_end[s], 1
        away = s in problem.offload  # an offloaded stage holds only the F running
        while n < t and (1 if away else n + 1) * c.activation[s] <= problem.limit[s] + MEMORY_EPS:
            late = clock >= arrives if overshoot else clock + c.f[s] > arrives + 1e-12
            if late:  # the next F would end (overshoot: start) after the gradient arrives
                break
            clock, n = clock + c.f[s], n + 1
        depths[s] = n
        back = max(clock, arrives) + c.b[s]
    for s in range(1, d):
        depths[s] = max(1, min(depths[s], depths[s - 1] - 1))
    return depths


def _hops(problem: Problem) -> tuple[list[float], list[float]]:
    """Per stage, the time an F's output takes to the next stage and an I's gradient to the stage before."""
    place = problem.placement
    stages = range(place.num_stages)
    return (
        [problem.hop(s, place.next_stage(s)) for s in stages],
        [problem.hop(s, place.prev_stage(s)) for s in stages],
    )


def _choose(
    rank: _Rank,
    now: float,
    policy: Policy,
    nf: list[int],
    ni: list[int],
    nw: list[int],
    f_ready: list[list[float]],
    i_ready: list[list[float]],
    activation: tuple[float, ...],
    t: int,
) -> Action | None:
    """The action a free rank starts at ``now``, or None to wait."""
    if policy.f_first and rank.in_flight < rank.cap:
        forward = _forward(rank, now, nf, f_ready, activation, t)
        if forward is not None:
            return forward
    # I first: it passes the gradient upstream and frees memory (an offloaded stage's I first brings its
    # microbatch back: it waits for room, which a pending W makes).
    best_i: Action | None = None
    for s in rank.stages:
        j = ni[s]
        room = s not in rank.offload or rank.held + activation[s] <= rank.limit
        if j < nf[s] and i_ready[s][j] <= now and room and (best_i is None or j < best_i.microbatch):
            best_i = Action(s, Op.I, j)
    if best_i is not None:
        return best_i
    if policy.lookahead:
        return _fill_gap(rank, now, policy, nf, ni, nw, f_ready, i_ready, activation, t)
    return _greedy(rank, now, policy, nf, nw, ni, f_ready, activation, t)


def _next_i(rank: _Rank, nf: list[int], ni: list[int], i_ready: list[list[float]]) -> float:
    """When the next gradient is known to arrive (inf when not known yet)."""
    return min((i_ready[s][ni[s]] for s in rank.stages if ni[s] < nf[s]), default=math.inf)


def _next_f(rank: _Rank, nf: list[int], f_ready: list[list[float]], activation: tuple[float, ...], t: int) -> float:
    """When the next F the rank may run (cap and memory) is known to arrive (inf: not known)."""
    if rank.in_flight >= rank.cap:
        return math.inf
    return min(
        (f_ready[s][nf[s]] for s in rank.stages if nf[s] < t and rank.held + activation[s] <= rank.limit),
        default=math.inf,
    )


def _fill_gap(
    rank: _Rank,
    now: float,
    policy: Policy,
    nf: list[int],
    ni: list[int],
    nw: list[int],
    f_ready: list[list[float]],
    i_ready: list[list[float]],
    activation: tuple[float, ...],
    t: int,
) -> Action | None:
    """Greedy, but never start what would still run when a known gradient arrives."""
    action = _greedy(rank, now, policy, nf, nw, ni, f_ready, activation, t)
    gap = _next_i(rank, nf, ni, i_ready) - now
    if policy.look_f:
        gap = min(gap, _next_f(rank, nf, f_ready, activation, t) - now)
    if action is None or gap == math.inf or rank.durations[action.stage][action.op] <= gap + 1e-12:
        return action
    if rank.pending_w:  # a W that fits, else wait for the gradient
        s = min((s for s in rank.stages if nw[s] < ni[s]), key=lambda s: nw[s])
        fits = rank.durations[s][Op.W] <= gap + 1e-12
        if fits or (policy.balance and rank.idle + gap > max(p.idle for p in rank.peers) + 1e-12):
            return Action(s, Op.W, nw[s])
    return None


def _greedy(
    rank: _Rank,
    now: float,
    policy: Policy,
    nf: list[int],
    nw: list[int],
    ni: list[int],
    f_ready: list[list[float]],
    activation: tuple[float, ...],
    t: int,
) -> Action | None:
    """F if the warm-up cap and memory allow it, else the oldest W, else wait."""
    w_first = rank.pending_w > policy.w_lag
    if not w_first and rank.in_flight < rank.cap:
        forward = _forward(rank, now, nf, f_ready, activation, t)
        if forward is not None:
            return forward
    if rank.pending_w:
        oldest = min((s for s in rank.stages if nw[s] < ni[s]), key=lambda s: nw[s])
        return Action(oldest, Op.W, nw[oldest])
    if w_first and rank.in_flight < rank.cap:  # no W left to run first
        return _forward(rank, now, nf, f_ready, activation, t)
    return None


def _forward(
    rank: _Rank,
    now: float,
    nf: list[int],
    f_ready: list[list[float]],
    activation: tuple[float, ...],
    t: int,
) -> Action | None:
    """An arrived F that fits in memory, or None.

    In a V, a shallow chunk's F must leave room for the deep chunk's F of the
    same microbatch: filling memory with shallow F's would starve the deep
    chunk, whose I is what frees memory (a deadlock).
    """
    for s in rank.stages:
        j = nf[s]
        if j >= t or f_ready[s][j] > now:
            continue
        need = rank.held + activation[s]
        need += sum(activation[d] for d in rank.stages if d > s and nf[d] <= j)
        if need <= rank.limit:
            return Action(s, Op.F, j)
    return None


def _result(problem: Problem, ranks: list[_Rank]) -> Result:
    span = max(rk.free_at - rk.starts[0] for rk in ranks)
    return Result([rk.order for rk in ranks], [rk.starts for rk in ranks], span, max(rk.free_at for rk in ranks))


def policies(problem: Problem) -> Iterator[Policy]:
    """The grid the heuristic tries, most promising first (1F1B-like depth first)."""
    d = problem.num_stages
    # A V holds two chunks per microbatch and warms up about twice as deep.
    extras = [d, 2 * d, d // 2, 4, 2, 1, 0] if problem.vshape else [0, 1, 2, 4, d // 2, d]
    slopes = [1.0, 0.5, 0.0]
    lags = [math.inf, 1.0, 0.0, 2.0]
    deep = [True, False] if problem.vshape else [True]
    # Best on REFERENCE.md's rows (ZB-1p, ZB-2p) and on V shapes, measured: tried first.
    first_v = [Policy(extra=d, slope=1.0, lookahead=True, f_first=True), Policy(extra=d, slope=1.0)]
    # W only where it delays no F and no I, unless waiting makes this rank the idlest (the paper's
    # rule): reaches REFERENCE.md's six 1.5B rows (ZB-1p at 1F1B's depth, ZB-2p at ZB-H2's).
    paper = Policy(slope=1.0, lookahead=True, f_first=True, look_f=True, balance=True)
    first_straight = [
        paper,
        Policy(lookahead=True, f_first=True, look_f=True, balance=True),
        Policy(lookahead=True, f_first=True, look_f=True),
        Policy(extra=1, slope=1.0, lookahead=True, f_first=True, look_f=True, balance=True),
        Policy(slope=1.0, lookahead=True, f_first=True),
        Policy(slope=1.0),
        Policy(extra=1, slope=1.0),
        Policy(extra=1, slope=1.0, f_first=True),
    ]
    seen: set[Policy] = set()
    for p in first_v if problem.vshape else first_straight:
        seen.add(p)
        yield p
    # Most promising first: the budget may stop the walk after a few policies.
    # (lookahead, look_f, balance): the last two refine the lookahead, so they need it.
    looks = ((True, True, True), (True, False, True), (True, True, False), (True, False, False), (False, False, False))
    grid = itertools.product(deep, (True, False), looks, lags, slopes, list(dict.fromkeys(extras)))
    for first, f_first, (look, look_f, balance), lag, slope, extra in grid:
        p = Policy(
            extra=extra,
            slope=slope,
            w_lag=lag,
            deep_first=first,
            lookahead=look,
            f_first=f_first,
            look_f=look_f,
            balance=balance,
        )
        if p not in seen:
            seen.add(p)
            yield p


def timed_policies(problem: Problem) -> list[Policy]:
    """The paper's own warm-ups (``timed_depths``), with and without its rules for W, tried by
    ``heuristic`` beyond its work budget: at D = 32 they are the best (benchmarks/search/README.md)."""
    if problem.vshape:
        return []
    rules = Policy(lookahead=True, f_first=True, look_f=True, balance=True)
    return [
        Policy(timed=k, lookahead=r.lookahead, f_first=r.f_first, look_f=r.look_f, balance=r.balance)
        for k in (1, 2)
        for r in (rules, Policy())
    ]


def one_at_a_time(problem: Problem) -> Result:
    """The fallback that always fits: one microbatch in the pipeline at a time."""
    place, t = problem.placement, problem.num_microbatches
    order: Order = [[] for _ in range(problem.num_ranks)]
    for j in range(t):
        route = place.pipelines[0]
        for s in route:
            order[place.stage_rank[s]].append(Action(s, Op.F, j))
        for s in reversed(route):
            order[place.stage_rank[s]] += [Action(s, Op.I, j), Action(s, Op.W, j)]
    return evaluate(problem, order)


def evaluate(problem: Problem, order: Order) -> Result:
    """ASAP start times of a given order (the simulator's semantics, no validation)."""
    from pipeweave.autoschedule.build import to_schedule
    from pipeweave.schedule.dataflow import execute

    run = execute(
        to_schedule(problem, order, updates=False),
        duration=lambda a: problem.duration(a.stage, a.op),
        latency=(lambda x, y: problem.costs.comm) if problem.costs.comm else None,
    )
    if not run.complete:
        raise ValueError("the order cannot complete")  # pragma: no cover - callers pass valid orders
    span = max(row_end[-1] - row_start[0] for row_start, row_end in zip(run.start, run.end))
    makespan = max(row_end[-1] for row_end in run.end)
    return Result(order, run.start, span, makespan)


# Actions list-scheduled per call, over all policies tried (about a second of Python:
# benchmarks/search/README.md), and a deterministic cut (a wall-clock one would change the
# result with the machine's load).
WORK_BUDGET = 75_000


def heuristic(
    problem: Problem,
    *,
    budget_s: float | None = None,
    work_budget: int = WORK_BUDGET,
    timed: bool = True,
    seeds: bool = True,
) -> Result:
    """The best list schedule over the first policies of ``policies(problem)``.

    Args:
        problem: the instance.
        budget_s: an optional wall-clock limit (the first policy always runs); None, the
            default, keeps the result independent of the machine's load.
        work_budget: policies are tried while (policies x actions) stays within it,
            and no longer once one meets the lower bound.
        timed: then also the paper's timed warm-ups (``timed_policies``), whatever the budget;
            False leaves them out (to measure what they add).
        seeds: then also the registry's hand-built orders that fit (``autoschedule.seeds``), kept where strictly
            better; False leaves them out (to measure what they add).

    Example:
        >>> from pipeweave.autoschedule.problem import problem_from_times
        >>> heuristic(problem_from_times(4, 8, activation_limit=2)).span
        24.0
    """
    from pipeweave.autoschedule.bound import lower_bound

    deadline = math.inf if budget_s is None else time.perf_counter() + budget_s
    bound = lower_bound(problem)
    best: Result | None = None
    count = max(1, work_budget // (3 * problem.num_microbatches * problem.num_parts))
    extra = timed_policies(problem) if timed else []
    for policy in itertools.chain(itertools.islice(policies(problem), count), extra):
        result = list_schedule(problem, policy)
        if result is not None and (best is None or result.span < best.span - 1e-12):
            best = result
        if best is not None and best.span - bound <= 1e-9 * best.span:
            break  # proven optimal: no policy can do better
        if time.perf_counter() > deadline:
            break
    unproven = best is None or best.span - bound > 1e-9 * best.span
    for order in seed_orders(problem) if seeds and unproven else ():
        result = evaluate(problem, order)
        if best is None or result.span < best.span - 1e-12:
            best = result
    return best if best is not None else one_at_a_time(problem)
