"""Units of the commands: human-readable sizes, cost flags checked once, this machine's free memory (``pipeweave.host``)."""

from __future__ import annotations

import argparse

from pipeweave.config.sections import parse_bytes
from pipeweave.errors import BYTES_AT_LEAST, UserError, renamed_activation_limit
from pipeweave.sim.cost import cost_problem


def format_bytes(n: float, digits: int = 1) -> str:
    """``format_bytes(3 * 2**20)`` -> ``'3.0 MiB'``: binary units, whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} GiB"


def memory_bytes(text: str, flag: str = "--memory-limit") -> float:
    """``--memory-limit`` where it once meant the activation multiple K: bytes per rank (``parse_bytes``), a
    bare number below ``BYTES_AT_LEAST`` refused as K under its former name.

    Raises:
        UserError: not a size > 0, or a bare number below ``BYTES_AT_LEAST`` (the line names ``--activation-limit``).

    Example:
        >>> memory_bytes("8GiB")
        8589934592.0
    """
    value = parse_bytes(text, flag)
    if value < BYTES_AT_LEAST and not text.strip()[-1:].isalpha():
        raise renamed_activation_limit(value)
    return value


def refuse_memory_limit(args: argparse.Namespace, command: str) -> None:
    """``--memory-limit`` given to a command that takes the activation multiple K (``--activation-limit``) only.

    Raises:
        UserError: K under its former name (the line names ``--activation-limit``), or bytes, which ``command``
            does not take.
    """
    if args.memory_limit is None:
        return
    memory_bytes(args.memory_limit)
    raise UserError(
        f"--memory-limit {args.memory_limit} is bytes per rank, which {command} does not take; "
        "give the activation multiple K as --activation-limit K"
    )


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


def parse_values(flag: str, text: str, what: str = "time") -> float | list[float]:
    """``"1.5"`` -> 1.5, ``"1,2,1"`` -> [1.0, 2.0, 1.0]: one value, or one per part; ``what`` names them in errors.

    Raises:
        UserError: a value that is not a number >= 0, or too large (``sim.cost.MAX_COST``).

    Example:
        >>> parse_values("--param-bytes", "4e6,2e6", "number of bytes")
        [4000000.0, 2000000.0]
    """
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a number; give one {what}, or one per part as a comma list") from None
    if any(v < 0 for v in values):
        raise UserError(f"{flag} {text!r} has a negative {what}; give {what}s >= 0")
    scalar = len(values) == 1 and "," not in text
    for v in values:
        problem = cost_problem(v, what)
        if problem is not None:
            raise UserError(f"{flag} {text.strip()} {problem}" if scalar else f"{flag} {text!r}: {v:g} {problem}")
    return values[0] if scalar else values
