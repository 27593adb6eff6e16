"""The schedules' generator options (the asynchronous ones', DualPipe's F&B overlap) on ``pipeweave simulate``'s command line (they change the
order, so the simulator sees them). ``pipeweave train`` has the same options as fields of its configuration's
schedule section (``config.sections.GENERATOR_OPTIONS``); a flag given to a schedule that does not take it
is one error line.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from pipeweave.config.sections import GENERATOR_OPTIONS
from pipeweave.errors import UserError
from pipeweave.schedule.registry import SCHEDULES

SCHEDULE_FLAGS = GENERATOR_OPTIONS
"""flag -> generator option (the schedules whose generator takes that option take the flag)."""


def add_schedule_arguments(g: Any) -> None:
    """The generator options of the asynchronous schedules, on a parser or argument group."""
    g.add_argument("--warmup-steps", type=int, help="pipemare: leading mini-batches run synchronously (default 0)")
    g.add_argument(
        "--vertical-sync",
        action="store_true",
        default=None,
        help="pipedream: every stage reads the version stage 0 read",
    )
    g.add_argument("--update-every", type=int, help="pipedream, spectrain: microbatches per update (default 1)")
    g.add_argument(
        "--in-flight",
        type=int,
        help="pipedream: microbatches stage 0 admits before its first backward (default NOAM = D)",
    )
    g.add_argument("--min-update-frequency", type=int, help="ampnet: local gradients per update (default 1)")
    g.add_argument("--max-active-keys", type=int, help="ampnet: microbatches in flight (default D)")
    g.add_argument("--pipelines", type=int, metavar="P", help="avgpipe: replicated pipelines (default 2)")
    g.add_argument(
        "--own-ranks",
        action="store_true",
        default=None,
        help="avgpipe: each pipeline on D ranks of its own (P x D ranks, averaged by an all-reduce)",
    )
    g.add_argument(
        "--no-overlap-fb",
        dest="overlap_fb",
        action="store_false",
        default=None,
        help="dualpipe, dualpipe-v: run the F&B pairs one after the other (default: overlapped)",
    )


def _given(args: argparse.Namespace, flags: dict[str, tuple[str, str]], schedule: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag, (key, takers) in flags.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if schedule not in takers.split(", "):
            shown = "--no-overlap-fb" if flag == "overlap_fb" else f"--{flag.replace('_', '-')}"  # a negated flag
            raise UserError(f"{shown} applies to {takers}, not {schedule}; drop it")
        out[key] = value
    return out


def schedule_options(args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    """The generator options the flags give for ``schedule``.

    Raises:
        UserError: a flag the schedule does not take.

    Example:
        >>> schedule_options(argparse.Namespace(warmup_steps=2), "pipemare")
        {'warmup_steps': 2}
    """
    flags = {
        flag: (
            option,
            ", ".join(n for n, info in SCHEDULES.items() if option in inspect.signature(info.generator).parameters),
        )
        for flag, option in SCHEDULE_FLAGS.items()
    }
    return _given(args, flags, schedule)
