"""The critical path of a simulated timeline, as counts of each part's F, I, W and of hops: a lower bound on
the makespan of the same schedule under any other times.

A rank runs its actions in order and an action starts after its inputs (plus a
hop from another rank): so any chain of actions, each one after the other on
its rank or fed by it, takes at least the sum of its times, whatever the times
are. The chain that decided the makespan under one set of times is found by
walking back from the last action, each time to the predecessor that ended
last (the one its start waited for). Under other times the same chain's sum
is a bound, tight when they are close to the first ones: what lets
``planner.search`` skip configurations of an already simulated shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeweave.schedule.ir import Op
from pipeweave.sim.timeline import Timeline

Key = tuple[int, Op, int]


@dataclass(frozen=True)
class Path:
    """Per part, how many of its F, I and W lie on the chain, and how many hops."""

    f: tuple[int, ...]
    i: tuple[int, ...]
    w: tuple[int, ...]
    hops: int

    def length(self, f: tuple[float, ...], i: tuple[float, ...], w: tuple[float, ...], hop: float) -> float:
        """The chain's time under per-part times ``f``, ``i``, ``w`` and ``hop`` per message."""
        return (
            sum(n * t for n, t in zip(self.f, f))
            + sum(n * t for n, t in zip(self.i, i))
            + sum(n * t for n, t in zip(self.w, w))
            + self.hops * hop
        )


def critical_path(timeline: Timeline) -> Path:
    """The chain that ends last (module docstring).

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.timeline import simulate
        >>> p = critical_path(simulate(generate("1f1b", num_stages=2, num_microbatches=2)))
        >>> p.length((1.0, 1.0), (1.0, 1.0), (1.0, 1.0), 0.0)  # (T + D - 1) x 3
        9.0
    """
    schedule = timeline.schedule
    placement = schedule.placement
    where = {(s, op, j): (r, n) for r, row in enumerate(timeline.events) for n, ((s, op, j), _, _) in enumerate(row)}
    parts = schedule.num_parts
    counts = {Op.F: [0] * parts, Op.I: [0] * parts, Op.W: [0] * parts}
    hops = 0
    rank, n = max(
        ((r, len(row) - 1) for r, row in enumerate(timeline.events) if row),
        key=lambda rn: timeline.events[rn[0]][rn[1]].end,
    )
    while True:
        event = timeline.events[rank][n]
        stage, op, j = event.action
        part = placement.stage_part[stage]
        for counted in (Op.I, Op.W) if op is Op.B else (op,) if op in counts else ():
            counts[counted][part] += 1
        found = _predecessor(timeline, where, rank, n)
        if found is None:
            break
        (rank_before, n), crossed = found, found[0] != rank
        hops += crossed
        rank = rank_before
    return Path(tuple(counts[Op.F]), tuple(counts[Op.I]), tuple(counts[Op.W]), hops)


def _predecessor(timeline: Timeline, where: dict[Key, tuple[int, int]], rank: int, n: int) -> tuple[int, int] | None:
    """The action whose end ``timeline.events[rank][n]`` waited for: its input, or the one before it on its rank."""
    event = timeline.events[rank][n]
    stage, op, j = event.action
    placement = timeline.schedule.placement
    inputs: list[Key] = []
    if op is Op.F:
        prev = placement.prev_stage(stage)
        inputs = [] if prev is None else [(prev, Op.F, j)]
    elif op in (Op.I, Op.B):
        nxt = placement.next_stage(stage)
        inputs = [(stage, Op.F, j)] + ([] if nxt is None else [(nxt, Op.I, j), (nxt, Op.B, j)])
    elif op is Op.W:
        inputs = [(stage, Op.I, j)]
    candidates = [where[k] for k in inputs if k in where]
    if n > 0:
        candidates.append((rank, n - 1))
    if not candidates:
        return None
    return max(candidates, key=lambda rn: timeline.events[rn[0]][rn[1]].end)
