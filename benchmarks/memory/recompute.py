"""Selective against full recomputation on the gpt with 4 stages: rank 0's memory saved, and the time it costs.

For each attention kernel -- ``flash`` (what torch runs on the CPU by default:
a fused kernel that keeps no s^2 scores) and ``math`` (the unfused softmax(QK^T)V,
keeping the s x s probabilities for the backward, as Megatron-LM did when
Korthikanti et al. measured selective recomputation) -- and each mode
(``none``, ``selective``, ``full``), 1F1B runs in one process (the reference
executor, ``runtime.reference``: every stage's actions in the schedule's
order, the same ``StageWorker`` and saved-tensor meter a rank uses) and
reports:

- rank 0's peak activation bytes (its stage's meter: what it holds for its
  backwards, as ``pipeweave train`` reports per rank);
- the CPU time of a step: every stage's work one after another on one
  thread, so a recomputation's replays add to it exactly as to the ranks'
  busy time (this 2-core machine cannot time 4 ranks side by side).

Modes alternate within each round; every round's times are kept, the median
reported. ``--train`` also runs ``pipeweave train`` on 4 gloo ranks (flash only: the
run's own kernel) and reports the per-rank peaks it measured. Run from the
repository root::

    python benchmarks/memory/recompute.py --rounds 5 --train --out benchmarks/memory/recompute.json
"""

from __future__ import annotations

import argparse
import dataclasses
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

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeweave.models import ModelSpec
from pipeweave.runtime.reference import run_reference
from pipeweave.schedule import generate

SPEC = ModelSpec(kind="gpt", layers=6, hidden=128, heads=4, seq_len=256)  # 8 layers: 2 per stage (--heads changes it)
STAGES, MICROBATCHES, BATCH = 4, 8, 32
MODES = ("none", "selective", "full")
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def _step(spec: ModelSpec, kernel: str, mode: str, steps: int) -> tuple[int, float]:
    """Rank 0's peak activation bytes and the CPU seconds per step of ``steps`` steps (after one untimed).

    CPU time of this process (one intra-op thread), not wall time: the machine is shared, and a
    process waiting for a core would count that wait in wall time."""
    schedule = generate("1f1b", num_stages=STAGES, num_microbatches=MICROBATCHES)
    with sdpa_kernel(KERNELS[kernel]):
        run_reference(schedule, spec, steps=1, batch_size=BATCH, recompute=mode)  # warm-up: allocator, imports
        start = time.process_time()
        result = run_reference(schedule, spec, steps=steps, batch_size=BATCH, recompute=mode)
        seconds = (time.process_time() - start) / steps
    return result.peak_activation_bytes[0], seconds


def _train(spec: ModelSpec, mode: str) -> dict[str, Any]:
    """``pipeweave train`` on 4 ranks: per rank, peak saved activations and tensors, and the estimate."""
    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "train.json"
        command = [sys.executable, "-m", "pipeweave.cli", "train", "-s", "1f1b", "--stages", str(STAGES),
                   "--microbatches", str(MICROBATCHES), "--batch", str(BATCH), "--model", "gpt", "--layers",
                   str(spec.layers), "--hidden", str(spec.hidden), "--heads", str(spec.heads), "--seq-len",
                   str(spec.seq_len), "--steps", "2", "--recompute", mode, "--quiet", "--out", folder,
                   "--json", str(record)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
        report = json.loads(record.read_text())
    return {"peak_activation_bytes": report["peak_activation_bytes"], "peak_tensor_bytes": report["peak_tensor_bytes"],
            "estimated_activation_bytes": report["memory_estimate"]["activations"]}


def _summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Selective's share of full's memory saving, and its time cost as a share of full's."""
    none, selective, full = (rows[m] for m in MODES)
    saved = {m: none["rank0_peak_bytes"] - rows[m]["rank0_peak_bytes"] for m in ("selective", "full")}
    cost = {m: rows[m]["step_s"] / none["step_s"] - 1 for m in ("selective", "full")}
    return {"selective_share_of_full_saving": saved["selective"] / saved["full"] if saved["full"] else None,
            "selective_time_cost": cost["selective"], "full_time_cost": cost["full"],
            "selective_cost_share_of_full": cost["selective"] / cost["full"] if cost["full"] > 0 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument("--train", action="store_true", help="also run pipeweave train on 4 ranks per mode")
    parser.add_argument("--heads", type=int, default=SPEC.heads, help="attention heads (scores grow with them)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    spec = dataclasses.replace(SPEC, heads=args.heads)
    torch.set_num_threads(1)  # as one rank runs
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}", "torch": torch.__version__,
        "model": vars(spec) | {"stages": STAGES, "microbatches": MICROBATCHES, "batch": BATCH}, "kernels": {}}
    for kernel in KERNELS:
        peaks: dict[str, int] = {}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for k in range(args.rounds):
            order = MODES if k % 2 == 0 else MODES[::-1]  # alternate, so drifting load hits every mode alike
            for mode in order:
                peaks[mode], seconds = _step(spec, kernel, mode, args.steps)
                times[mode].append(seconds)
            print(f"{kernel} round {k}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in MODES), flush=True)
        rows = {m: {"rank0_peak_bytes": peaks[m], "step_s": statistics.median(times[m]), "rounds_s": times[m]}
                for m in MODES}
        results["kernels"][kernel] = {"modes": rows, **_summary(rows)}
        print(json.dumps(results["kernels"][kernel] | {"modes": {m: {k: v for k, v in r.items() if k != "rounds_s"}
                                                                    for m, r in rows.items()}}), flush=True)
    if args.train:
        results["train"] = {mode: _train(spec, mode) for mode in MODES}
        print(json.dumps(results["train"]), flush=True)
    results["load"] = os.getloadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
