"""The memory levers' flags, one spelling on every command: ``--offload``, ``--balance-activations``,
``--compress-activations`` and the host link's ``--host-bandwidth`` (``schedule.stash``, ``sim.stash``)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from typing import TYPE_CHECKING

from pipeweave.errors import UserError
from pipeweave.schedule.ir import Schedule
from pipeweave.schedule.stash import COMPRESSIONS, DEFAULT_BANDWIDTH, StashPlan, parse_offload

if TYPE_CHECKING:
    from pipeweave.sim.cost import PartCosts
    from pipeweave.sim.metrics import Metrics
    from pipeweave.sim.timeline import Timeline


def add_stash_arguments(p: argparse.ArgumentParser, *, bandwidth: bool = True) -> None:
    """The memory levers' group of options (``bandwidth``: with ``--host-bandwidth``, for the simulator)."""
    g = p.add_argument_group("memory levers", "saved activations moved away between F and the backward")
    g.add_argument("--offload", metavar="PARTS", default=None,
                   help="offload the saved activations of these parts to host memory after F and reload them "
                   "before the backward: all, or part numbers comma-separated (default none)")
    g.add_argument("--balance-activations", action="store_true",
                   help="BPipe: a rank above its pair's mean peak sends a share of its activations to rank D-1-r "
                   "after F and takes it back before the backward")
    g.add_argument("--compress-activations", choices=sorted(COMPRESSIONS), default=None,
                   help="stash saved activations in this format between F and the backward (lossy; default off)")
    if bandwidth:
        g.add_argument("--host-bandwidth", type=float, default=None, metavar="R", help=(
            f"memory actions' link: units of M_a moved per time unit (default {DEFAULT_BANDWIDTH:g}: a GPT layer "
            "on a 25 GB/s host link, sim/stash.py)"))


def stash_plan(args: argparse.Namespace, num_parts: int) -> StashPlan:
    """The levers the flags ask for (``StashPlan()`` when none).

    Raises:
        UserError: a bad ``--offload`` part or ``--host-bandwidth``.
    """
    bandwidth = getattr(args, "host_bandwidth", None)
    if bandwidth is not None and not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise UserError(f"--host-bandwidth {bandwidth:g} is invalid; give a finite bandwidth > 0, e.g. 0.25")
    return StashPlan(offload=parse_offload(getattr(args, "offload", None) or "none", num_parts),
                     balance=bool(getattr(args, "balance_activations", False)),
                     compress=getattr(args, "compress_activations", None))


def train_levers(args: argparse.Namespace) -> dict[str, Any]:
    """``TrainConfig``'s fields of the levers (parts checked against the schedule by the run's plan).

    Raises:
        UserError: an ``--offload`` part that is no number.
    """
    if args.offload not in (None, "all", "none"):
        parse_offload(args.offload, 1 << 30)  # numbers; the run's plan checks them against the schedule's parts
    return {"offload": None if args.offload in (None, "none") else args.offload,
            "compress_activations": args.compress_activations, "balance_activations": args.balance_activations}


def plan_dict(plan: StashPlan, shares: tuple[float, ...], bandwidth: float) -> dict[str, Any]:
    """The levers as ``--json`` reports them."""
    return {"offload": sorted(plan.offload), "balance_activations": plan.balance,
            "compress_activations": plan.compress, "host_bandwidth": bandwidth, "moved_share": list(shares)}


def simulate_levers(schedule: Schedule, costs: PartCosts, plan: StashPlan, bandwidth: float | None = None,
                    ) -> tuple[Metrics, Timeline, dict[str, Any]]:
    """Metrics with ``plan`` applied (``peak_activations`` per rank with the memory actions), the timeline
    to show (memory actions as their own events) and the levers' JSON.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.cost import CostModel
        >>> s = generate("1f1b", num_stages=4, num_microbatches=8)
        >>> m, _, _ = simulate_levers(s, CostModel().for_parts(num_parts=4, num_ranks=4), StashPlan(balance=True))
        >>> m.peak_activations
        (2.714287, 2.6, 2.6, 2.714284)
    """
    from pipeweave.sim.metrics import compute_metrics
    from pipeweave.sim.stash import simulate_stash, stash_events, stash_peaks
    from pipeweave.sim.timeline import Timeline

    bandwidth = bandwidth or DEFAULT_BANDWIDTH
    comm = costs.comm
    timeline, stash, extra = simulate_stash(schedule, costs, plan, bandwidth=bandwidth,
                                            hop=(lambda src, dst: comm) if comm else None)
    shown = Timeline(schedule, stash_events(stash, timeline, extra), timeline.costs)
    assert timeline.costs is not None
    metrics = compute_metrics(timeline)
    metrics = dataclasses.replace(metrics, peak_activations=stash_peaks(stash, shown.events, timeline.costs))
    return metrics, shown, plan_dict(plan, stash.share, bandwidth)


def levered_activations(schedule: Schedule, activations: tuple[float, ...], plan: StashPlan) -> tuple[float, ...]:
    """Per part, the peak microbatches its rank holds (``partition.memory.MemoryProfile.activations``) with
    ``plan`` applied: each part scaled by its rank's simulated peak with the levers over the peak without
    (uniform M_a), so that the ``memory`` partitioner splits for the memory the levers leave.

    Example:
        >>> from pipeweave.schedule import generate
        >>> levered_activations(generate("1f1b", num_stages=4, num_microbatches=8), (4.0, 3.0, 2.0, 1.0),
        ...                     StashPlan(offload=frozenset({0})))
        (1.0, 3.0, 2.0, 1.0)
    """
    from pipeweave.sim.cost import CostModel
    from pipeweave.sim.metrics import compute_metrics
    from pipeweave.sim.timeline import simulate

    if not plan.active:
        return activations
    costs = CostModel().for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    before = compute_metrics(simulate(schedule, CostModel(), check=False)).peak_activations
    after = simulate_levers(schedule, costs, plan)[0].peak_activations
    rank_of = schedule.placement.stage_rank
    stage_of = {part: stage for stage, part in enumerate(schedule.placement.stage_part)}
    return tuple(round(a * after[rank_of[stage_of[k]]] / before[rank_of[stage_of[k]]], 9) if before[
        rank_of[stage_of[k]]] else a for k, a in enumerate(activations))
