"""``pipeweave compare --measure``: each approach run for real by ``pipeweave train --json``, in alternating rounds.

One ``pipeweave train`` process per approach and round (round 1 runs every
approach once, then round 2, ...: a slow spell of the machine spreads over all
approaches instead of landing on one), so a row's measured figures are exactly
what ``pipeweave train`` records for that approach alone; the median over the
rounds is kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeweave.schedule.registry import SCHEDULES

# train's JSON field -> compare's column
FIELDS = {
    "step_time_s": "measured_step_time_s",
    "samples_per_s": "measured_samples_per_s",
    "bubble_ratio": "measured_bubble_ratio",
    "bubble_ratio_simulated": "measured_bubble_ratio_simulated",
    "peak_activation_bytes": "measured_peak_activation_bytes",
    "weight_bytes": "measured_weight_bytes",
}
MODEL_FLAGS = ("layers", "hidden", "vocab", "heads", "seq_len", "seed")


def train_argv(name: str, args: argparse.Namespace, folder: Path) -> list[str]:
    """The ``pipeweave train`` command line of one approach, its outputs in ``folder``."""
    argv = [
        "train",
        "-s",
        name,
        "--stages",
        str(args.stages),
        "--microbatches",
        str(args.microbatches),
        "--steps",
        str(args.measure),
        "--batch",
        str(args.batch),
        "--model",
        args.model,
        "--quiet",
        "--out",
        str(folder),
        "--json",
        str(folder / "train.json"),
    ]
    for key in MODEL_FLAGS:
        if getattr(args, key, None) is not None:
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if getattr(args, "tie_embeddings", False):
        argv += ["--tie-embeddings"]
    if SCHEDULES[name].chunks is None:
        argv += ["--chunks", str(args.chunks)]
    return argv


def train_record(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``pipeweave train --json``'s record of one run of ``name``, or ``{"error": its last line}``."""
    with tempfile.TemporaryDirectory(prefix="pipeweave-compare-") as tmp:
        folder = Path(tmp)
        done = subprocess.run(
            [sys.executable, "-m", "pipeweave.cli", *train_argv(name, args, folder)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
            return {"error": lines[-1]}
        return dict(json.loads((folder / "train.json").read_text()))


def measure(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Add each row's measured columns: the median over ``args.rounds`` alternating rounds."""
    records: dict[str, list[dict[str, Any]]] = {r["name"]: [] for r in rows}
    for _ in range(args.rounds):
        for name in records:
            records[name].append(train_record(name, args))
    for row in rows:
        runs = [r for r in records[row["name"]] if "error" not in r]
        if not runs:
            row["measured_error"] = records[row["name"]][0]["error"]
            continue
        for field, column in FIELDS.items():
            row[column] = _median([r[field] for r in runs])


def _median(values: list[Any]) -> Any:
    """The median of numbers, or per rank of lists."""
    if isinstance(values[0], list):
        return [statistics.median(v) for v in zip(*values)]
    return statistics.median(values)
