"""``pipeweave train``: train a model with a schedule on local ranks (or under torchrun), measured.

With no arguments it trains the byte-level gpt on the Python standard
library's sources, on 2 ranks with a zero-bubble schedule where the registry
has one (1F1B otherwise), shows a progress bar, and ends with a summary --
loss first -> last, throughput, measured beside simulated bubble, memory per
rank -- and a JSON record, a Chrome trace and a timeline plot under
``./pipeweave-out/``.

Asynchronous schedules (pipedream, pipedream-2bw, pipemare, spectrain, xpipe,
ampnet, wpipe, avgpipe) run as one stream of ``--steps`` mini-batches
(``runtime.stream``), drained and restarted where ``--eval-every`` or
``--save-every`` stop it; their options are in the "asynchronous schedules" group
of ``--help``, and the summary shows the steady-state bubble and the weight
bytes held (every version and buffer) beside the simulator's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeweave.config import TrainConfig
from pipeweave.config.cli import add_arguments

DEFAULT_OUT = Path("pipeweave-out")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``pipeweave train``: one option per field of ``TrainConfig`` (``config.cli``), grouped by section, and
    ``--config``/``--print-config``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "train",
        help="train a model with a pipeline schedule on local ranks, measured",
        description="Train on torch.distributed with any schedule; measure bubble, memory, throughput. "
        "An asynchronous schedule runs as one stream of --steps mini-batches, drained where --eval-every or "
        "--save-every stop it. Every option is a field of pipeweave.TrainConfig; a TOML file holds the same "
        "fields by section.",
    )
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="read the configuration from a TOML file (sections as the groups below); options given here override it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as TOML (a file --config reads) and exit",
    )
    add_arguments(p, TrainConfig)
    return p


def run(args: argparse.Namespace) -> int:
    """Train (``commands.train_run``: imported here, so that parsing any subcommand needs no torch)."""
    from pipeweave.commands.train_run import train

    return train(args)
