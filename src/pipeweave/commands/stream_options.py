"""Command-line options of the asynchronous schedules (``pipeweave train`` and ``pipeweave simulate``).

Two kinds: options of the schedule generators (they change the order, so the
simulator sees them too) and run-time hyperparameters of the weight policies
(``runtime.stage.policy.PolicyOptions``, ``train`` only). Defaults are the
generators' and the policies', taken from their papers; a flag given to a
schedule that does not take it is one error line.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from pipeweave.errors import UserError
from pipeweave.schedule.registry import SCHEDULES

# flag -> generator option (the schedules whose generator takes that option take the flag)
SCHEDULE_FLAGS = {
    "warmup_steps": "warmup_steps",
    "vertical_sync": "vertical_sync",
    "update_every": "update_every",
    "min_update_frequency": "min_update_frequency",
    "max_active_keys": "max_active_keys",
    "pipelines": "num_pipelines",
}
# flag -> (PolicyOptions field, the schedule that takes it)
POLICY_FLAGS = {
    "anneal_steps": ("anneal_steps", "pipemare"),
    "decay": ("decay", "pipemare"),
    "averaging_rate": ("averaging_rate", "avgpipe"),
    "averaging_period": ("averaging_period", "avgpipe"),
}


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
    g.add_argument("--min-update-frequency", type=int, help="ampnet: local gradients per update (default 1)")
    g.add_argument("--max-active-keys", type=int, help="ampnet: microbatches in flight (default D)")
    g.add_argument("--pipelines", type=int, metavar="P", help="avgpipe: replicated pipelines (default 2)")


def add_async_arguments(p: argparse.ArgumentParser) -> None:
    """``pipeweave train``: generator options, momentum and the policies' hyperparameters."""
    g = p.add_argument_group(
        "asynchronous schedules",
        "A stream of --steps mini-batches with no flush (avgpipe: --steps/P rounds of P pipelines). "
        "Losses are per mini-batch, as its forwards computed them.",
    )
    g.add_argument(
        "--momentum",
        type=float,
        help="SGD momentum (default 0.9 for spectrain/xpipe, which predict along it; 0 otherwise)",
    )
    add_schedule_arguments(g)
    g.add_argument(
        "--anneal-steps",
        type=int,
        metavar="K",
        help="pipemare: updates over which the step size lr/tau returns to lr (default 1000; 0: off)",
    )
    g.add_argument("--decay", type=float, help="pipemare: velocity moving-average weight gamma (default 0.9)")
    g.add_argument("--no-correction", action="store_true", help="pipemare: no discrepancy correction")
    g.add_argument(
        "--averaging-rate",
        type=float,
        metavar="ALPHA",
        help="avgpipe: elastic averaging rate toward the replicas' mean (default 0.9/P)",
    )
    g.add_argument("--averaging-period", type=int, help="avgpipe: update rounds between averagings (default 1)")


def _given(args: argparse.Namespace, flags: dict[str, tuple[str, str]], schedule: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag, (key, takers) in flags.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if schedule not in takers.split(", "):
            raise UserError(f"--{flag.replace('_', '-')} applies to {takers}, not {schedule}; drop it")
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


def async_options(args: argparse.Namespace, schedule: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The generator options and the keyword arguments of ``PolicyOptions`` the flags give for ``schedule``.

    Raises:
        UserError: a flag the schedule does not take, or an invalid value.
    """
    policy = _given(args, POLICY_FLAGS, schedule)
    if getattr(args, "no_correction", False):
        if schedule != "pipemare":
            raise UserError(f"--no-correction applies to pipemare, not {schedule}; drop it")
        policy["correction"] = False
    return schedule_options(args, schedule), policy
