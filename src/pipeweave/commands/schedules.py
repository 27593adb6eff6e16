"""``pipeweave schedules``: every registered schedule with its family, closed forms and what it supports."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeweave.schedule.registry import SCHEDULES


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "schedules",
        help="list the schedule names, their family and closed forms",
        description="List every schedule the registry knows (the -s values of simulate and train), "
        "with its paper, whether it is synchronous, its placement, and its bubble and memory closed forms "
        "(D stages, T microbatches, v chunks, M_a activations and M_theta weights of one stage); --json adds "
        "what each supports (I/W split, searched, data parallelism, ties, ZeRO, default options).",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def rows() -> list[dict[str, Any]]:
    """One dict per registry entry, in registry order (read at call time: others add entries)."""
    return [
        {
            "name": name,
            "family": info.family,
            "synchronous": info.synchronous,
            "bubble": info.bubble,
            "activations": info.activations,
            "weights": info.weights,
            "chunks": info.chunks,
            "placement": info.placement.value,
            "splits_backward": info.splits_backward,
            "searched": info.searched,
            "data_parallel": info.data_parallel.value,
            "ties": info.ties,
            "zero": info.zero,
            "defaults": dict(info.defaults),
        }
        for name, info in SCHEDULES.items()
    ]


def run(args: argparse.Namespace) -> int:
    entries = rows()
    if args.json:
        print(json.dumps({"schedules": entries}))
        return 0
    table = Table(title=f"{len(entries)} schedules (pipeweave simulate -s NAME)", show_lines=False)
    for column, style in (
        ("name", "bold"),
        ("family", ""),
        ("sync", ""),
        ("placement", ""),
        ("bubble", ""),
        ("activations", ""),
        ("weights", ""),
    ):
        table.add_column(column, style=style or None, no_wrap=column in ("name", "sync", "placement"))
    for e in entries:
        table.add_row(
            e["name"],
            e["family"],
            "sync" if e["synchronous"] else "async",
            e["placement"],
            e["bubble"],
            e["activations"],
            e["weights"],
        )
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    return 0
