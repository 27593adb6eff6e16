"""Human-readable sizes for the commands' tables."""

from __future__ import annotations


def format_bytes(n: float, digits: int = 1) -> str:
    """``format_bytes(3 * 2**20)`` -> ``'3.0 MiB'``: binary units, whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} GiB"
