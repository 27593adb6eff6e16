"""The memory levers' flags, one spelling on every command: ``--offload``, ``--balance-activations``,
``--compress-activations`` and the host link's ``--host-bandwidth`` (``schedule.levers``, ``sim.levers``)."""

from __future__ import annotations

import argparse
import math

from pipeweave.commands.recompute_options import AUTO
from pipeweave.errors import UserError
from pipeweave.schedule.levers import COMPRESSIONS, DEFAULT_BANDWIDTH, StashPlan, parse_offload


def add_stash_arguments(
    p: argparse.ArgumentParser, *, bandwidth: bool = True, auto: bool = False, stream: bool = False
) -> None:
    """The memory levers' group of options (``bandwidth``: with ``--host-bandwidth``, for the simulator;
    ``auto``: ``--offload auto``, chosen per part by the command; ``stream``: ``--copy-stream``)."""
    g = p.add_argument_group("memory levers", "saved activations moved away between F and the backward")
    g.add_argument(
        "--offload",
        metavar="PARTS",
        default=None,
        help="offload the saved activations of these parts to host memory after F and reload them "
        "before the backward: all, or part numbers comma-separated (default none)"
        + ("; auto: the parts chosen with the schedule under --activation-limit" if auto else ""),
    )
    g.add_argument(
        "--balance-activations",
        action="store_true",
        help="BPipe: a rank above its pair's mean peak sends a share of its activations to rank D-1-r "
        "after F and takes it back before the backward",
    )
    g.add_argument(
        "--compress-activations",
        choices=sorted(COMPRESSIONS),
        default=None,
        help="stash saved activations in this format between F and the backward (lossy; default off)",
    )
    if bandwidth:
        g.add_argument(
            "--host-bandwidth",
            type=float,
            default=None,
            metavar="R",
            help=(
                f"memory actions' link: units of M_a moved per time unit (default {DEFAULT_BANDWIDTH:g}: a GPT layer "
                "on a 25 GB/s host link, sim/levers.py)"
            ),
        )
    if stream:
        g.add_argument(
            "--copy-stream",
            action="store_true",
            help="offload's copies on a side stream beside the compute, as on CUDA (pinned memory); "
            "default: on the rank's compute path, as the CPU runtime's file copies",
        )


def stash_plan(args: argparse.Namespace, num_parts: int, *, auto: bool = False) -> StashPlan:
    """The levers the flags ask for (``StashPlan()`` when none); ``auto``: the command takes ``--offload auto``
    (``autoschedule.offload`` chooses the parts; the plan holds none of them).

    Raises:
        UserError: a bad ``--offload`` part or ``--host-bandwidth``.
    """
    bandwidth = getattr(args, "host_bandwidth", None)
    if bandwidth is not None and not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise UserError(f"--host-bandwidth {bandwidth:g} is invalid; give a finite bandwidth > 0, e.g. 0.25")
    offload = getattr(args, "offload", None)
    if offload == AUTO and not auto:
        raise UserError("--offload auto is chosen by `pipeweave search`; give all, none or part numbers here")
    return StashPlan(
        offload=parse_offload("none" if offload in (None, AUTO) else offload, num_parts),
        balance=bool(getattr(args, "balance_activations", False)),
        compress=getattr(args, "compress_activations", None),
    )
