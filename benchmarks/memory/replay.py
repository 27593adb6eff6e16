"""The simulator's peak activations under recomputation against the peaks a run measures, with and without the replay.

A recomputing part replays its forward before each backward and holds the
replayed activations while that backward runs (``sim.cost.PartCosts.replayed``).
This script runs 1F1B (D = 4, T = 8) on the gpt of ``recompute.py``, with
each attention kernel of ``recompute.py`` (``flash``, torch's CPU default;
``math``, which keeps the s x s probabilities that selective recomputation
replays), in the reference executor (``runtime.reference``: every stage in one process, the
same ``StageWorker`` and saved-tensor meter a rank uses) for each mode, and
reads every rank's measured peak activation bytes. The simulator's prediction
is built from each part's bytes for one microbatch as the runtime measures
them before a run (``runtime.run.part_memory``: M_a without recomputation,
and the share each mode keeps, ``kept_selective`` / ``kept_full``), so only the
memory model differs: ``before`` leaves the replay out (what the simulator
did), ``after`` counts it. Run from the repository root::

    python benchmarks/memory/replay.py --out benchmarks/memory/replay.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeweave.models import ModelSpec
from pipeweave.runtime.reference import run_reference
from pipeweave.config import TrainConfig
from pipeweave.runtime.run.part_memory import part_memory
from pipeweave.runtime.run.prepare import prepare
from pipeweave.schedule import generate
from pipeweave.sim import CostModel
from pipeweave.sim.metrics import peak_activations
from pipeweave.sim.timeline import simulate

SPEC = ModelSpec(kind="gpt", layers=6, hidden=128, heads=4, seq_len=256)  # as recompute.py
STAGES, MICROBATCHES, BATCH = 4, 8, 32
MODES = ("selective", "full")
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def _held(mode: str, cache: str) -> list[int]:
    """Per part, what a microbatch holds from its F to its backward under ``mode`` (``part_memory``; ``cache``:
    one folder per kernel, which its key does not name)."""
    config = TrainConfig(schedule="1f1b", num_stages=STAGES, num_microbatches=MICROBATCHES, batch_size=BATCH,
                         model=SPEC, recompute=mode, steps=10, optimizer="sgd", lr=0.1, momentum=0.0)
    return [p.held for p in part_memory(config, prepare(config).parts, ("B",), cache_dir=cache)]


def _predicted(mode: str, plain: list[int], cache: str) -> dict[str, list[float]]:
    """Per rank, the simulator's peak bytes with the replay (``after``) and without (``before``)."""
    kept = [h / p for h, p in zip(_held(mode, cache), plain)]
    cost = CostModel(activation=[float(p) for p in plain], recompute=mode, **{f"kept_{mode}": kept})
    timeline = simulate(generate("1f1b", num_stages=STAGES, num_microbatches=MICROBATCHES), cost)
    assert timeline.costs is not None
    return {"after": list(peak_activations(timeline, timeline.costs)),
            "before": list(peak_activations(timeline, dataclasses.replace(timeline.costs, replayed=())))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as one rank runs
    schedule = generate("1f1b", num_stages=STAGES, num_microbatches=MICROBATCHES)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}", "torch": torch.__version__,
        "load_start": os.getloadavg()[0], "model": vars(SPEC) | {"stages": STAGES, "microbatches": MICROBATCHES,
                                                                 "batch": BATCH},
        "kernels": {}}
    for kernel, backend in KERNELS.items():
        with sdpa_kernel(backend), tempfile.TemporaryDirectory() as cache:
            plain = _held("none", cache)
            results["kernels"][kernel] = found = {"part_bytes_none": plain}
            for mode in MODES:
                measured = run_reference(schedule, SPEC, steps=1, batch_size=BATCH,
                                         recompute=mode).peak_activation_bytes
                predicted = _predicted(mode, plain, cache)
                found[mode] = {"measured": list(measured), **predicted, **{
                    f"error_{k}": [p / m - 1 for p, m in zip(v, measured)] for k, v in predicted.items()}}
                print(kernel, mode, json.dumps(found[mode]), flush=True)
    results["load_end"] = os.getloadavg()[0]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
