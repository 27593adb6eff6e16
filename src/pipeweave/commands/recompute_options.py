"""``--recompute``, one spelling on ``train``, ``simulate``, ``search`` and ``partition`` (``sim.recompute``)."""

from __future__ import annotations

import argparse
from typing import Any

from pipeweave.commands.units import parse_values
from pipeweave.config.sections import AUTO  # noqa: F401  (--recompute auto, re-exported)
from pipeweave.errors import UserError
from pipeweave.sim.recompute import RECOMPUTE, parse_recompute


def add_recompute_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, auto: bool = False) -> None:
    """``--recompute MODE[,MODE...]``; bare ``--recompute`` means ``full`` (the former switch); ``auto``: the
    command chooses per part under its memory limit."""
    parser.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default="none",
        metavar="|".join(RECOMPUTE + ((AUTO,) if auto else ())),
        help="activation recomputation: none, selective (the attention core, Korthikanti et al.) or full, for "
        "every part or one per part comma-separated, e.g. full,selective,none,none (bare: full)"
        + (
            "; auto: chosen per part under the limit (search: --activation-limit, partition: --memory-limit)"
            if auto
            else ""
        ),
    )


def add_recompute_cost_arguments(parser: argparse.ArgumentParser, *, auto: bool = False) -> None:
    """What recomputation costs and saves where the costs are typed in (``simulate``, ``search``): a number
    or one per part, in the units of ``--time-f`` and of M_a."""
    g = parser.add_argument_group("recomputation costs", "a number, or a comma list with one value per part")
    add_recompute_argument(g, auto=auto)
    g.add_argument(
        "--time-selective",
        default="0",
        metavar="R",
        help="time of replaying the selective region (the attention core) of one D-th of the model "
        "(default 0); full recomputation replays the whole forward, --time-f",
    )
    g.add_argument(
        "--activation-selective",
        default="1",
        metavar="A",
        help="M_a kept under selective recomputation, as a fraction of M_a (default 1: nothing saved)",
    )
    g.add_argument(
        "--activation-full",
        default="0",
        metavar="A",
        help="M_a kept under full recomputation (the part's input), as a fraction of M_a (default 0)",
    )


def recompute_costs(args: argparse.Namespace, *, auto: bool = False) -> dict[str, Any]:
    """The ``CostModel`` fields of ``add_recompute_cost_arguments``' flags, checked (one line each); ``auto``
    gives every part ``full`` (the least memory, where ``autoschedule.recompute`` starts).

    Raises:
        UserError: an unknown mode, a time that is not >= 0, a fraction outside [0, 1].
    """
    if args.recompute == AUTO and not auto:
        raise UserError(
            "--recompute auto is chosen under a memory limit by search and partition --partition memory; "
            "give the modes here (none, selective, full or one per part)"
        )
    if args.recompute != AUTO:
        parse_recompute(args.recompute)
    fields: dict[str, Any] = {
        "recompute": "full" if args.recompute == AUTO else args.recompute,
        "replay_selective": parse_values("--time-selective", args.time_selective),
    }
    for flag, name in (("--activation-selective", "kept_selective"), ("--activation-full", "kept_full")):
        value = parse_values(flag, getattr(args, flag[2:].replace("-", "_")), "fraction")
        if any(v > 1 for v in (value if isinstance(value, list) else [value])):
            raise UserError(
                f"{flag} {getattr(args, name.replace('kept', 'activation'))} is invalid; give the "
                "fraction of M_a kept, in [0, 1]"
            )
        fields[name] = value
    return fields
