"""A 3D run's measured step beside its simulated one, and beside the same model without tensor or data parallelism.

Runs ``pipeweave train`` (its own launcher, default transport) on a small gpt
for each configuration, in alternating order over ``--rounds`` rounds, and
reads from each run's JSON record the measured step (``makespan_s``: the
median over the measured steps of the step's span across ranks) and the
simulated one (``makespan_simulated_s``: the run's schedule simulated with
the per-part F, I/B, W and U times and the dispatch time the run profiled
from itself -- tensor-parallel collectives inside F and I, the replicas'
reduction inside the wait at U). Reported per configuration: every round's
pair, the median ratio simulated / measured. Run from the repository root::

    python benchmarks/parallel/step.py --rounds 3 --out benchmarks/parallel/step.json
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

MODEL = ["--model", "gpt", "--layers", "4", "--hidden", "128", "--heads", "4", "--seq-len", "64", "--batch", "16",
         "--microbatches", "4", "--optimizer", "sgd", "--steps", "12"]
CONFIGS = {
    "pp2 (1 x 2 x 1)": ["--stages", "2"],
    "pp2 tp2 (1 x 2 x 2)": ["--stages", "2", "--tensor-parallel", "2"],
    "dp2 pp2 (2 x 2 x 1)": ["--stages", "2", "--data-parallel", "2"],
    "dp2 pp2 tp2 (2 x 2 x 2)": ["--stages", "2", "--data-parallel", "2", "--tensor-parallel", "2"],
}


def _run(schedule: str, extra: list[str], folder: Path) -> dict[str, Any]:
    record = folder / "train.json"
    command = [sys.executable, "-m", "pipeweave.cli", "train", "-s", schedule, *MODEL, *extra, "--quiet",
               "--out", str(folder), "--json", str(record)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
    report = json.loads(record.read_text())
    return {"measured_s": report["makespan_s"], "simulated_s": report["makespan_simulated_s"],
            "loss": report["losses"][-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-s", "--schedule", default="1f1b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "host": f"{platform.machine()}, {os.cpu_count()} cores", "schedule": args.schedule,
        "model": " ".join(MODEL), "load_start": os.getloadavg()[0], "configs": {name: [] for name in CONFIGS},
    }
    names = list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                results["configs"][name].append(_run(args.schedule, CONFIGS[name], Path(tmp)))
    results["load_end"] = os.getloadavg()[0]
    for name, rounds in results["configs"].items():
        ratios = [x["simulated_s"] / x["measured_s"] for x in rounds]
        results["configs"][name] = {"rounds": rounds, "median_ratio_simulated_over_measured": statistics.median(ratios),
                                    "median_measured_s": statistics.median(x["measured_s"] for x in rounds)}
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
