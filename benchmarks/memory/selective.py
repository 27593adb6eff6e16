"""Selective against full recomputation per transformer block, at Korthikanti et al.'s memory ratio 5as/h = 80.

Korthikanti et al. (MLSys 2023, section 4) count a GPT layer's stored activations as
s b h (34 + 5 a s / h) bytes: 34 s b h for the linear parts, 5 a s^2 b for the attention
core (scores, softmax, its dropout mask). Selective recomputation drops the second term,
full recomputation keeps only the layer's input (2 s b h). GPT-3 175B (a = 96, s = 2048,
h = 12288) has 5 a s / h = 80: selective then saves 80 / (34 + 80 - 2) = 71 % of what full
saves, the ~70 % they report. Their ~3 % time cost comes from the other ratio, the core's
FLOPs over the block's, about s / 6h (2.8 % at GPT-3's shape).

So every shape here has 5 a s / h = 80 (the paper's memory regime, chosen for that and not
tuned), at widths h = 128, 512, 1024 (s = 256, so a = 8, 32, 64 heads of width 16), which
walk s / 6h from 33 % towards GPT-3's 2.8 %. Per shape and mode, one gpt block (a ``StageWorker``
part of one block, the unfused ``math`` attention kernel that keeps the s^2 scores as
Megatron-LM's did) runs F then its backward on a microbatch of 4 sequences: the bytes the
microbatch keeps from F to its backward (the stage's saved-tensor meter: what the paper
counts), and the CPU time (``time.thread_time``, one thread: the machine is shared) of F +
backward, the modes alternating within each round; medians over the rounds. Run from the
repository root::

    python benchmarks/memory/selective.py --rounds 3 --repeats 2 --out benchmarks/memory/selective.json
    python benchmarks/memory/selective.py --rounds 3 --repeats 2 --precision bf16 --widths 128 512 \
        --out benchmarks/memory/selective_bf16.json   # bf16 runs ~6x slower on this CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.stage.worker import StageWorker

SEQ, MICROBATCH, RATIO = 256, 4, 80  # 5 a s / h = RATIO, as GPT-3 175B
WIDTHS = (128, 512, 1024)
MODES = ("none", "selective", "full")


def _spec(hidden: int) -> ModelSpec:
    heads = RATIO * hidden // (5 * SEQ)
    return ModelSpec(kind="gpt", layers=1, hidden=hidden, heads=heads, seq_len=SEQ)


def _block(spec: ModelSpec, mode: str, repeats: int, precision: str) -> tuple[int, float]:
    """Bytes one microbatch keeps in the block from F to its backward, and the median CPU s of F + backward."""
    worker = StageWorker(spec, range(1, 2), batch_size=MICROBATCH, recompute=mode, precision=precision)
    x = torch.randn(MICROBATCH, SEQ, spec.hidden)
    held, times = 0, []
    with sdpa_kernel(SDPBackend.MATH):
        for j in range(repeats + 1):  # the first is a warm-up
            start = time.thread_time()
            out = worker.forward(j, x.clone().requires_grad_())
            held = worker.activation_bytes()
            worker.backward(j, torch.ones_like(out))
            if j:
                times.append(time.thread_time() - start)
    return held, statistics.median(times)


def _shares(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    none, selective, full = (rows[m] for m in MODES)
    saved = {m: none["held_bytes"] - rows[m]["held_bytes"] for m in ("selective", "full")}
    cost = {m: rows[m]["cpu_s"] / none["cpu_s"] - 1 for m in ("selective", "full")}
    return {"selective_share_of_full_saving": saved["selective"] / saved["full"],
            "selective_time_cost": cost["selective"], "full_time_cost": cost["full"],
            "selective_cost_share_of_full": cost["selective"] / cost["full"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="timed microbatches per mode and round")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: every forward under bfloat16 autocast, the paper's mixed precision")
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="h of the shapes (5as/h = 80 each)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as one rank runs
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": platform.machine(), "torch": torch.__version__, "precision": args.precision, "shapes": {}}
    for hidden in args.widths:
        spec = _spec(hidden)
        rounds: dict[str, list[float]] = {m: [] for m in MODES}
        held: dict[str, int] = {}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
                held[mode], seconds = _block(spec, mode, args.repeats, args.precision)
                rounds[mode].append(seconds)
        rows = {m: {"held_bytes": held[m], "cpu_s": statistics.median(rounds[m]), "rounds_s": rounds[m]} for m in MODES}
        shape = {"hidden": hidden, "heads": spec.heads, "seq_len": SEQ, "5as/h": 5 * spec.heads * SEQ / hidden,
                 "s/6h": SEQ / (6 * hidden), "load": open("/proc/loadavg").read().split()[0]}
        results["shapes"][str(hidden)] = {**shape, "modes": rows, **_shares(rows)}
        print(json.dumps({**shape, **_shares(rows), **{m: {k: v for k, v in row.items()} for m, row in rows.items()}}),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
