"""Units of the commands: human-readable sizes, cost flags checked once, this machine's free memory (``pipeweave.host``)."""

from __future__ import annotations

import argparse

from pipeweave.errors import UserError
from pipeweave.sim.cost import cost_problem


def format_bytes(n: float, digits: int = 1) -> str:
    """``format_bytes(3 * 2**20)`` -> ``'3.0 MiB'``: binary units, whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} GiB"


def check_cost_flags(args: argparse.Namespace, flags: tuple[tuple[str, str], ...]) -> None:
    """Refuse, in one line naming the flag, a cost that is negative, nan, inf or too large (``sim.cost.MAX_COST``).

    ``flags`` pairs each flag with what it measures, e.g. ``(("--time-comm", "latency"),)``;
    a flag left unset (None) is skipped.

    Raises:
        UserError: e.g. ``--time-comm nan is invalid; give a finite latency >= 0``.
    """
    for flag, what in flags:
        value = getattr(args, flag[2:].replace("-", "_"))
        problem = None if value is None else cost_problem(value, what)
        if problem is not None:
            raise UserError(f"{flag} {value} {problem}")
