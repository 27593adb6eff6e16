"""``--recompute``, one spelling on ``train``, ``simulate``, ``search`` and ``partition`` (``sim.recompute``)."""

from __future__ import annotations

import argparse

from pipeweave.sim.recompute import RECOMPUTE


def add_recompute_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--recompute MODE[,MODE...]``; bare ``--recompute`` means ``full`` (the former switch)."""
    parser.add_argument(
        "--recompute", nargs="?", const="full", default="none", metavar="|".join(RECOMPUTE),
        help="activation recomputation: none, selective (the attention core, Korthikanti et al.) or full, for "
             "every part or one per part comma-separated, e.g. full,selective,none,none (bare: full)")


def add_recompute_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """What recomputation costs and saves where the costs are typed in (``simulate``, ``search``): a number
    or one per part, in the units of ``--time-f`` and of M_a."""
    g = parser.add_argument_group("recomputation costs", "a number, or a comma list with one value per part")
    add_recompute_argument(g)
    g.add_argument("--time-selective", default="0", metavar="R",
                   help="time of replaying the selective region (the attention core) of one D-th of the model "
                        "(default 0); full recomputation replays the whole forward, --time-f")
    g.add_argument("--activation-selective", default="1", metavar="A",
                   help="M_a kept under selective recomputation, as a fraction of M_a (default 1: nothing saved)")
    g.add_argument("--activation-full", default="0", metavar="A",
                   help="M_a kept under full recomputation (the part's input), as a fraction of M_a (default 0)")
