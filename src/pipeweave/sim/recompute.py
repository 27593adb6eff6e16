"""Activation recomputation as a choice per part: none, selective or full (Korthikanti et al., MLSys 2023).

- ``none``: a part keeps every activation its backward needs (M_a);
- ``selective``: a part replays only its *selective region* before the
  backward -- for a transformer the attention core softmax(QK^T)V, whose
  activations grow with s^2 and which costs little to replay -- and keeps the
  rest;
- ``full``: a part keeps only its input and replays its whole forward before
  the backward.

One spelling everywhere: a single mode for every part, or one mode per part
comma-separated (``"none,selective,full,full"``); a bool means ``full`` or
``none`` (the old ``--recompute`` switch).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeweave.errors import UserError

RECOMPUTE = ("none", "selective", "full")
"""The modes, least memory saved first."""

Recompute = bool | str | Sequence[str]


def parse_recompute(value: Recompute) -> tuple[str, ...]:
    """The modes ``value`` names: one for every part, or one per part.

    Raises:
        UserError: a mode outside ``RECOMPUTE``, or an empty list.

    Example:
        >>> parse_recompute("none,selective"), parse_recompute(True), parse_recompute("full")
        (('none', 'selective'), ('full',), ('full',))
    """
    if isinstance(value, bool):
        return ("full" if value else "none",)
    modes = tuple(m.strip() for m in (value.split(",") if isinstance(value, str) else value))
    bad = [m for m in modes if m not in RECOMPUTE]
    if not modes or bad:
        shown = value if isinstance(value, str) else ",".join(map(str, value))
        raise UserError(
            f"--recompute {shown!r} is invalid; give one of {', '.join(RECOMPUTE)}, or one per part "
            "comma-separated, e.g. selective,none"
        )
    return modes


def per_part(value: Recompute, num_parts: int) -> tuple[str, ...]:
    """One mode per part: a single mode repeated, or the list checked against ``num_parts``.

    Raises:
        UserError: a list of another length (or an invalid mode).

    Example:
        >>> per_part("selective", 3), per_part("full,none", 2)
        (('selective', 'selective', 'selective'), ('full', 'none'))
    """
    modes = parse_recompute(value)
    if len(modes) == 1:
        return modes * num_parts
    if len(modes) != num_parts:
        raise UserError(
            f"--recompute {','.join(modes)} gives {len(modes)} modes for {num_parts} parts; give one "
            "mode for every part or one per part"
        )
    return modes


def spelled(modes: Sequence[str]) -> str:
    """The one spelling of per-part modes: a single mode when all agree, else the comma list.

    Example:
        >>> spelled(("full", "full")), spelled(("full", "none"))
        ('full', 'full,none')
    """
    return modes[0] if len(set(modes)) == 1 else ",".join(modes)
