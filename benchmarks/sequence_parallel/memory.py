"""Peak bytes per rank of a tensor-parallel gpt with and without ``--sequence-parallel``, beside plan.memory's ratio.

Runs ``pipeweave train`` (TP = 2, D = 2: 4 processes) on a small gpt for each
schedule, without and with sequence parallelism, and reads from each run's
JSON record the measured ``peak_activation_bytes`` (saved-tensor hooks: what
a rank holds for its backward) and ``peak_tensor_bytes`` (every tensor alive
at once in the measured step) per rank, the final loss (the same with and
without: SP changes where activations live, not what is computed) and the
step (``makespan_s``, noisy on a shared machine). The memory estimate's
measurement cache is a fresh folder, so every run measures its own parts.
Beside them, ``plan.memory``'s per-block ratio (SP / TP alone, no
recomputation) for the same sizes. Run from the repository root::

    python benchmarks/sequence_parallel/memory.py --out benchmarks/sequence_parallel/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAYERS, HIDDEN, HEADS, SEQ_LEN, BATCH = 4, 64, 4, 64, 8
MODEL = ["--model", "gpt", "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--heads", str(HEADS), "--seq-len",
         str(SEQ_LEN), "--batch", str(BATCH), "--steps", "3", "--stages", "2", "--tensor-parallel", "2"]
SCHEDULES = ("1f1b", "zb-h1")


def measure(schedule: str, sequence_parallel: bool, folder: Path) -> dict[str, Any]:
    """One run's peaks, loss and step, read from its JSON record."""
    record = folder / "train.json"
    flags = ["--sequence-parallel"] if sequence_parallel else []
    command = [sys.executable, "-m", "pipeweave.cli", "train", "-s", schedule, *MODEL, *flags, "--quiet",
               "--out", str(folder), "--json", str(record)]
    env = {**os.environ, "PIPEWEAVE_CACHE": str(folder / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
    report = json.loads(record.read_text())
    keys = ("peak_activation_bytes", "peak_tensor_bytes", "makespan_s")
    return {**{k: report[k] for k in keys}, "loss": report["losses"][-1]}


def predicted_ratio() -> float:
    """``plan.memory``'s held bytes of a block, SP over TP alone, at TP = 2 (Korthikanti et al., Table 2)."""
    from pipeweave.planner.memory import block_activation_bytes
    from pipeweave.planner.transformer import Transformer

    model = Transformer(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq_len=SEQ_LEN)
    sp, tp = (block_activation_bytes(model, tp=2, recompute="none", sequence_parallel=on)[0] for on in (True, False))
    return sp / tp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
                           "cores": os.cpu_count(), "model": " ".join(MODEL), "load_start": os.getloadavg()[0],
                           "plan_memory_block_ratio": predicted_ratio(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in SCHEDULES:
            for on in (False, True):
                folder = Path(tmp) / f"{schedule}-{on}"
                folder.mkdir()
                out["runs"][f"{schedule}{' sp' if on else ''}"] = measure(schedule, on, folder)
    out["load_end"] = os.getloadavg()[0]
    sys.stdout.write(json.dumps(out, indent=1) + "\n")
    if args.out:  # the same JSON, kept beside the README
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
