"""Weight versions implied by a schedule's order and its weight policy.

A part's version is the number of ``U`` its stage has done. The policy says
which version each action reads (DESIGN.md's table); staleness and weight
copies follow from the order alone, without running anything.
"""

from __future__ import annotations

from pipeweave.schedule.ir import Schedule, WeightPolicy
from pipeweave.sim.cost import PartCosts


def weight_copies(schedule: Schedule, costs: PartCosts) -> tuple[float, ...]:
    """Per rank, the peak weight memory held, in M_theta."""
    if schedule.policy is not WeightPolicy.SYNC:
        raise NotImplementedError(f"weight copies under policy {schedule.policy} are not modelled yet")
    held = [0.0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement.stage_rank):
        held[rank] += costs.weight[schedule.placement.stage_part[stage]]
    return tuple(round(h, 9) for h in held)


def staleness(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most updates a gradient lags behind the version it updates."""
    if schedule.policy is not WeightPolicy.SYNC:
        raise NotImplementedError(f"staleness under policy {schedule.policy} is not modelled yet")
    return (0,) * schedule.num_stages
