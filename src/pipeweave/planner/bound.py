"""Lower bounds on a configuration's step time and memory, without its schedule: what lets the search
skip most of the space and still return the exact best configurations.

- **Time**: a rank must do all its own work, and cannot start before the first
  microbatch has crossed the parts before its first one (their F and one hop
  each); with two pipelines in opposite directions (Chimera, DualPipe, GEMS)
  both ends start at once, so only the work counts. And the last part's last
  backward comes after all of its T forwards and backwards, which start once
  the first microbatch reached it; that backward's gradient must then cross
  every earlier part's backward back to the first (a whole B each where the
  schedule does not split it into I and W, an I and the first part's last W
  where it does): for GPipe and 1F1B this is their makespan, (T + D - 1)(f + b).
  The naive schedule runs one microbatch at a time: T (f + b) over all parts.
  And with replicas, every part's gradients are reduced within the step, a
  rank's parts one after another (``Evaluator.dp_tail``): no step is shorter
  than the busiest rank's reductions (on a million replicas, what decides).
  The simulated step is never shorter: it adds the waits of the schedule, the
  DP reduction's tail.
- **Memory**: the model state of an average rank (the fullest holds at least
  as much), one microbatch's activations of one part, and the allowance.
"""

from __future__ import annotations

from pipeweave.planner.candidate import Config
from pipeweave.planner.evaluate import Evaluator
from pipeweave.planner.memory import ALLOWANCE_BYTES
from pipeweave.schedule.info import PlacementKind
from pipeweave.schedule.registry import SCHEDULES
from pipeweave.sim.parallel import reduction_time


def rank_of_part(schedule: str, part: int, num_ranks: int) -> int:
    """The pipeline rank holding ``part`` (looped and straight: k mod D; V: down then back up).

    Example:
        >>> [rank_of_part("zb-v", k, 2) for k in range(4)]
        [0, 1, 1, 0]
    """
    if SCHEDULES[schedule].placement is PlacementKind.V_SHAPE and part >= num_ranks:
        return 2 * num_ranks - 1 - part
    return part % num_ranks


def time_bound(config: Config, evaluator: Evaluator) -> float:
    """Seconds no simulation of ``config`` can beat (module docstring)."""
    return max(_pipeline_bound(config, evaluator), reduction_bound(config, evaluator))


def reduction_bound(config: Config, evaluator: Evaluator) -> float:
    """Seconds the busiest pipeline rank spends reducing its parts' gradients over the replicas (0 without
    replicas); two pipelines in opposite directions hold part k on ranks k and D - 1 - k, which reduce it
    together."""
    placement = SCHEDULES[config.schedule].placement
    if config.dp == 1:
        return 0.0
    parts = evaluator.num_parts(config)
    key = (config.tp, config.pp, config.dp, parts, config.zero, placement, config.blocks, config.ep, config.cp)
    found = evaluator.known_reductions.get(key)
    if found is None:
        layout, params, busiest = evaluator.layout(config), evaluator.param_bytes(config, parts), [0.0] * config.pp
        for k in range(parts):
            holders = _holders(config.schedule, k, config.pp)
            for r in holders:
                busiest[r] += reduction_time(layout, params[k], num_ranks=config.pp, holders=holders)
        found = evaluator.known_reductions[key] = max(busiest)
    return found


def _holders(schedule: str, part: int, num_ranks: int) -> tuple[int, ...]:
    """The pipeline ranks holding ``part``: one, or both directions' of a bidirectional schedule."""
    if SCHEDULES[schedule].placement is PlacementKind.BIDIRECTIONAL:
        return tuple(sorted({part, num_ranks - 1 - part}))
    return (rank_of_part(schedule, part, num_ranks),)


def _pipeline_bound(config: Config, evaluator: Evaluator) -> float:
    """The pipeline's own bound: its work, its fill and its drain (module docstring)."""
    d = config.pp
    if SCHEDULES[config.schedule].placement is PlacementKind.BIDIRECTIONAL:
        f, i, w, _ = evaluator.times(config, d)
        cost = [a + b + c for a, b, c in zip(f, i, w)]
        return max(config.microbatches / 2 * (cost[r] + cost[d - 1 - r]) for r in range(d))
    parts = d * config.chunks
    f, i, w, hop = evaluator.times(config, parts)
    if config.schedule == "naive":  # one microbatch at a time, through every part and back
        return config.microbatches * sum(map(sum, (f, i, w)))
    busy, start = [0.0] * d, [-1.0] * d
    reach = 0.0  # when microbatch 0 can reach part k
    for k in range(parts):
        r = rank_of_part(config.schedule, k, d)
        busy[r] += config.microbatches * (f[k] + i[k] + w[k])
        if start[r] < 0:
            start[r] = reach
        reach += f[k] + hop
    last = parts - 1
    ranks = [rank_of_part(config.schedule, k, d) for k in range(parts)]
    reach_last = sum(f[k] + (hop if ranks[k] != ranks[k + 1] else 0.0) for k in range(last))
    whole = not SCHEDULES[config.schedule].splits_backward  # every backward one B: I and W together
    back = sum(i[k] + (w[k] if whole else 0.0) + (hop if ranks[k] != ranks[k + 1] else 0.0) for k in range(last))
    drain = reach_last + config.microbatches * (f[last] + i[last] + (w[last] if whole else 0.0)) + back
    return max(max(s + b for s, b in zip(start, busy)), drain + (0.0 if whole else w[0]))


def memory_bound(config: Config, evaluator: Evaluator) -> float:
    """Bytes the fullest GPU of ``config`` holds at least (module docstring)."""
    model = evaluator.cluster.model
    copies = 2 if SCHEDULES[config.schedule].placement is PlacementKind.BIDIRECTIONAL else 1
    experts = model.layers * getattr(model, "expert_parameters", 0.0) * (1 - 1 / config.ep)  # on other EP ranks
    per_gpu = (model.parameters - experts) * copies / (config.tp * config.pp)
    state = per_gpu * evaluator.cluster.state.sharded(config.zero, config.dp * config.cp)
    return state + evaluator.least_activation(config) + ALLOWANCE_BYTES
