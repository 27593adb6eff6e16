"""``pipeweave plan`` on this machine: the built-in gpt on a 2-rank "cluster" described by its own profile,
against ``pipeweave train`` measuring the configurations it can run here, side by side.

    PYTHONPATH=src python benchmarks/plan/local.py [--rounds 2] [--steps 10] [--out FOLDER]

1. The machine is described, not fitted: the gpt's per-layer profiles (``pipeweave partition --save-costs``,
   at microbatch sizes 4, 2 and 8, ``--repeats 20``), and one calibration run (``train -s 1f1b --stages 2 --microbatches 4``)
   for what the profile does not hold: the runtime's time between actions ("dispatch per action") and the
   latency of a pipeline message (read as the link's bandwidth for the gpt's activation).
2. ``pipeweave plan --costs PROFILE --gpu custom`` (no peak: the profiling machine itself) for 2 GPUs and
   train's global batch 16, ZeRO 0, ``--all --json``: every configuration predicted.
3. ``pipeweave train --json`` measures a grid of what train runs here at 2 ranks (DP 2 at T 1, 2, 4; a
   2-stage pipeline: 1f1b at T 2, 4, 8 and with recomputation at 4, gpipe, zb-h1, zb-h2, zb-v and
   interleaved-1f1b v=2 at T 4) and the plan's pick,
   ``--rounds`` rounds, the order reversed every other round. The median step of each is compared with its
   prediction; the plan's pick with the best measured.

Prints the load and every round, and a markdown table for benchmarks/plan/README.md; writes the records to
``--out`` (default /tmp/pipeweave-plan-local).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BATCH = 16
SIZES = (4, 2, 8)
"""Microbatch sizes profiled (the first is the plan's reference profile)."""
PIPELINE = ("1f1b", "gpipe", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b")


def cli(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pipeweave.cli", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pipeweave {' '.join(argv)} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def train(config: dict[str, Any], steps: int, folder: Path) -> dict[str, Any]:
    """One ``pipeweave train --json`` run of ``config`` (a plan's JSON configuration)."""
    out = folder / f"{label(config).replace(' ', '_')}.json"
    argv = ["train", "-s", config["schedule"], "--stages", str(config["pp"]), "--data-parallel", str(config["dp"]),
            "--microbatches", str(config["microbatches"]), "--batch", str(BATCH), "--steps", str(steps), "--quiet",
            "--json", str(out), "--out", str(folder / "out"), "--zero", str(config["zero"])]
    if config["schedule"] == "interleaved-1f1b":
        argv += ["--chunks", str(config["chunks"])]
    if config["recompute"] == "full":
        argv.append("--recompute")
    cli(*argv)
    record: dict[str, Any] = json.loads(out.read_text())
    return record


def label(c: dict[str, Any]) -> str:
    v = f" v={c['chunks']}" if c["schedule"] == "interleaved-1f1b" else ""
    rc = " rc" if c["recompute"] == "full" else ""
    return f"PP{c['pp']} DP{c['dp']} {c['schedule']}{v} T={c['microbatches']}{rc}"


def describe(folder: Path, repeats: int) -> tuple[list[Path], float, float]:
    """The profiles (microbatch sizes 2, 4, 8), and (dispatch seconds, link Gb/s) from one calibration run."""
    profiles = [folder / f"gpt_costs_b{b}.json" for b in SIZES]
    for b, path in zip(SIZES, profiles):
        cli("partition", "--stages", "2", "--microbatches", str(BATCH // b), "--batch-size", str(BATCH),
            "--save-costs", str(path), "--repeats", str(repeats), "--refresh")
    calib = train({"schedule": "1f1b", "pp": 2, "dp": 1, "microbatches": 4, "chunks": 1, "recompute": "none",
                   "zero": 0}, 10, folder)
    costs = calib["profiled_costs_s"]
    message = json.loads(profiles[1].read_text())["output"][0]  # an activation between layers at b = 4, bytes
    gbps = message * 8 / max(costs["comm"] - 5e-6, 1e-6) / 1e9
    return profiles, costs["dispatch"], gbps


def planned(profiles: list[Path], dispatch: float, gbps: float) -> list[dict[str, Any]]:
    out = cli("plan", "--costs", *map(str, profiles), "--gpu", "custom", "--memory-gib", "16", "--intra-node-gbps",
              f"{gbps:.3f}", "--inter-node-gbps", f"{gbps:.3f}", "--gpus-per-node", "2", "--gpus", "2",
              "--global-batch", str(BATCH), "--dispatch", f"{dispatch:.6g}", "--zero", "0", "--all", "--json")
    configs: list[dict[str, Any]] = json.loads(out)["configurations"]
    return [c for c in configs if c["fits"]]


def grid(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What is measured: the plan's pick and a grid of what train runs here (module docstring)."""
    def wanted(c: dict[str, Any]) -> bool:
        t, rc, name = c["microbatches"], c["recompute"] == "full", c["schedule"]
        if c["dp"] == 2:
            return t in (1, 2, 4) and not rc
        if rc:
            return name == "1f1b" and t == 4
        if name == "1f1b":
            return t in (2, 4, 8)
        return name in PIPELINE and t == 4 and (name != "interleaved-1f1b" or c["chunks"] == 2)
    return [configs[0]] + [c for c in configs[1:] if wanted(c)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20, help="profiler repeats per layer")
    parser.add_argument("--out", default="/tmp/pipeweave-plan-local")
    args = parser.parse_args()
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    print(f"load at start: {load()}", flush=True)
    profiles, dispatch, gbps = describe(folder, args.repeats)
    print(f"machine: dispatch {dispatch * 1e3:.3f} ms per action, link {gbps:.2f} Gb/s", flush=True)
    configs = planned(profiles, dispatch, gbps)
    pick = configs[0]
    print(f"plan's pick: {label(pick)}, predicted {pick['step_time_s'] * 1e3:.1f} ms", flush=True)
    measured = grid(configs)
    steps: dict[str, list[float]] = {label(c): [] for c in measured}
    for r in range(args.rounds):
        order = measured if r % 2 == 0 else measured[::-1]
        for c in order:
            steps[label(c)].append(train(c, args.steps, folder)["step_time_s"])
            print(f"  {label(c)}: {steps[label(c)][-1] * 1e3:.1f} ms (load {load()})", flush=True)
        print(f"round {r + 1} done, load {load()}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f}" for k, v in steps.items()),
              flush=True)
    report(measured, steps, pick, started, args)


def report(measured: list[dict[str, Any]], steps: dict[str, list[float]], pick: dict[str, Any], started: float,
           args: argparse.Namespace) -> None:
    medians = {k: statistics.median(v) for k, v in steps.items()}
    best = min(medians, key=medians.__getitem__)
    rows = sorted(measured, key=lambda c: medians[label(c)])
    print(f"\n| configuration | predicted ms | measured ms (median) | rounds ms | predicted / measured |")
    print("|---|---:|---:|---|---:|")
    for c in rows:
        k = label(c)
        mark = " **(plan's pick)**" if c is pick else ""
        print(f"| {k}{mark} | {c['step_time_s'] * 1e3:.1f} | {medians[k] * 1e3:.1f} | "
              f"{', '.join(f'{x * 1e3:.1f}' for x in steps[k])} | {c['step_time_s'] / medians[k]:.2f} |")
    ratio = medians[label(pick)] / medians[best]
    print(f"\nplan's pick {label(pick)}: {medians[label(pick)] * 1e3:.1f} ms measured, best measured {best} "
          f"{medians[best] * 1e3:.1f} ms: {ratio:.3f}x, {'within' if ratio <= 1.10 else 'NOT within'} 10 %")
    print(f"{len(measured)} configurations x {args.rounds} rounds in {time.time() - started:.0f} s; "
          f"load at end {load()}")
    (Path(args.out) / "local.json").write_text(json.dumps({"steps": steps, "pick": label(pick), "best": best,
                                                           "predicted": {label(c): c["step_time_s"] for c in measured}}))


if __name__ == "__main__":
    main()
