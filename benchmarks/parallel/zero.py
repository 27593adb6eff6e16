"""ZeRO stages side by side: what a rank keeps of the weights, the tensors a step allocates, and the step.

Runs ``pipeweave train`` (its own launcher) on a small gpt at P = 2 data-parallel replicas of a 2-stage
zb-h1 pipeline, at ``--zero 0``, ``1`` and ``3`` (3: FSDP2, ``runtime/fsdp.py``), in alternating order over
``--rounds`` rounds, and reads from each run's JSON record, per rank: ``weight_bytes`` (the parameters kept
between actions), ``peak_activation_bytes`` (held for backwards), ``peak_tensor_bytes`` (the CPU tensor
meter's peak over the first step: every tensor created in the step, the weights alive before it excluded --
so ZeRO-3's gathered layers count there and ZeRO-0's whole weights do not), the measured step
(``makespan_s``, wall time, the median step's span across ranks) and the last loss (equal across stages:
they train the same model). Run from the repository root::

    python benchmarks/parallel/zero.py --rounds 3 --out benchmarks/parallel/zero.json

With ``PYTHONPATH`` pointing at another checkout's ``src`` it measures that one (the README compares
pipeweave's earlier ZeRO-3 of its own this way).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = ["--model", "gpt", "--layers", "8", "--hidden", "128", "--heads", "4", "--seq-len", "64", "--batch", "16",
         "--microbatches", "4", "--optimizer", "sgd", "--momentum", "0.9", "--steps", "12", "-s", "zb-h1",
         "--stages", "2", "--data-parallel", "2"]
STAGES = ("0", "1", "3")


def _run(zero: str, folder: Path) -> dict[str, Any]:
    record = folder / "train.json"
    command = [sys.executable, "-m", "pipeweave.cli", "train", *MODEL, "--zero", zero, "--quiet", "--out",
               str(folder), "--json", str(record)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
    report = json.loads(record.read_text())
    return {"step_s": report["makespan_s"], "weight_bytes": report["weight_bytes"],
            "peak_activation_bytes": report["peak_activation_bytes"],
            "peak_tensor_bytes": report["peak_tensor_bytes"], "loss": report["losses"][-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "host": f"{platform.machine()}, {os.cpu_count()} cores", "model": " ".join(MODEL),
        "load_start": os.getloadavg()[0], "zero": {z: [] for z in STAGES},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for zero in STAGES if r % 2 == 0 else STAGES[::-1]:
                results["zero"][zero].append(_run(zero, Path(tmp)))
    results["load_end"] = os.getloadavg()[0]
    for zero, rounds in results["zero"].items():
        results["zero"][zero] = {"rounds": rounds, "median_step_s": statistics.median(x["step_s"] for x in rounds)}
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
