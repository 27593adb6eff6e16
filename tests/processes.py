"""The processes of a run, seen from outside: what a killed launcher or rank leaves behind."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid`` (its fork server, resource tracker, the ranks under the server), each with its
    parent."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: dict[int, int] = {}
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier and child not in found}
        found.update({child: parents[child] for child in frontier})
    return found
