"""Memory levers on the gpt with 4 stages, 1F1B: measured peak activation bytes per rank and step time
with offload (rank 0's part to a memory-mapped file), BPipe's balancing and bf16 compression, beside
exact training, and the offload's step-time cost as the simulator predicts it.

Runs ``pipeweave train`` (its own launcher, default transport) once per configuration per round, the
configurations alternating within each round, and reads each run's JSON record: ``peak_activation_bytes``
(the ranks' saved-tensor meters, first step), ``makespan_s`` (the median step). The prediction: the exact
run's schedule simulated with the per-part times it profiled from itself (``profiled_costs_s``), with and
without ``OFFLOAD``/``RELOAD`` of part 0 (``sim.levers``), the copies timed at the bandwidth of the whole
path (pack, file write; file read, rebuild) measured here on part 0's own microbatch. With ``--curve N``
it also trains the gpt N steps exact and with ``--compress-activations bf16`` (2 stages) for the loss
curves. Run from the repository root::

    python benchmarks/memory/levers.py --rounds 3 --curve 40 --out benchmarks/memory/levers.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAYERS, HIDDEN, HEADS, SEQ, BATCH, T = 14, 128, 4, 64, 16, 8  # 14 blocks + embedding + head: 4 layers a part
MODEL = ["--model", "gpt", "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--heads", str(HEADS),
         "--seq-len", str(SEQ), "--batch", str(BATCH), "--microbatches", str(T), "--optimizer", "sgd"]
CONFIGS = {"exact": [], "offload part 0": ["--offload", "0"], "BPipe": ["--balance-activations"],
           "bf16": ["--compress-activations", "bf16"]}


def _train(extra: list[str], folder: Path, stages: int = 4, steps: int = 6) -> dict[str, Any]:
    record = folder / "train.json"
    command = [sys.executable, "-m", "pipeweave.cli", "train", "-s", "1f1b", "--stages", str(stages), *MODEL,
               "--steps", str(steps), *extra, "--quiet", "--out", str(folder), "--json", str(record)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return json.loads(record.read_text())


def _copy_rate(repeats: int = 15, stages: int = 4, clock: Any = time.perf_counter) -> dict[str, float]:
    """Part 0's microbatch (of ``stages`` parts) moved to a file and back, the runtime's own path: bytes and
    seconds each way (``clock``: wall by default; ``time.thread_time`` for the CPU the copies take)."""
    import torch

    from pipeweave.models.spec import ModelSpec, uniform_parts
    from pipeweave.runtime.stage.levers import FileStore, stash_away, stash_back
    from pipeweave.runtime.stage.worker import StageWorker

    torch.set_num_threads(1)
    spec = ModelSpec(kind="gpt", layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq_len=SEQ)
    worker = StageWorker(spec, uniform_parts(spec.num_layers, stages)[0], batch_size=BATCH, stashing=True)
    store, away, back, size = FileStore(), [], [], 0
    tokens = torch.randint(0, spec.vocab, (BATCH // T, SEQ))
    for j in range(repeats):
        worker.forward(j, tokens)
        t0 = clock()
        packed = stash_away(worker, j)
        store.put((0, j), packed.buffer)
        size, packed.buffer = packed.nbytes, None
        t1 = clock()
        stash_back(worker, j, packed, store.take((0, j)))
        t2 = clock()
        worker.backward(j, torch.zeros(BATCH // T, SEQ, HIDDEN))
        away.append(t1 - t0)
        back.append(t2 - t1)
    store.close()
    out, ret = statistics.median(away), statistics.median(back)
    return {"bytes": size, "offload_s": out, "reload_s": ret, "bytes_per_s": 2 * size / (out + ret)}


def _predicted_cost(exact: dict[str, Any], rate: dict[str, float], stages: int = 4) -> float:
    """Simulated step with part 0 offloaded minus without, from the exact run's own profile."""
    from pipeweave.schedule import generate
    from pipeweave.schedule.levers import StashPlan
    from pipeweave.sim import CostModel, simulate
    from pipeweave.sim.levers import simulate_stash

    c = exact["profiled_costs_s"]
    activation = [float(rate["bytes"])] + [1.0] * (stages - 1)  # only part 0 moves
    cost = CostModel(f=c["f"], b=c["b"], w=c["w"], u=c["u"], dispatch=c["dispatch"], activation=activation)
    schedule = generate("1f1b", num_stages=stages, num_microbatches=T)
    costs = cost.for_parts(num_parts=stages, num_ranks=stages)
    plain = simulate(schedule, cost)
    moved, _, _ = simulate_stash(schedule, costs, StashPlan(offload=frozenset({0})), bandwidth=rate["bytes_per_s"])
    return max(e.end for row in moved.events for e in row) - max(e.end for row in plain.events for e in row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--curve", type=int, default=0, help="steps of the bf16 loss curve (0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": platform.machine(), "runs": {name: [] for name in CONFIGS}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, extra in CONFIGS.items():
                report = _train(extra, Path(tmp) / f"{r}-{len(results['runs'][name])}")
                row = {k: report[k] for k in ("peak_activation_bytes", "makespan_s", "makespan_simulated_s",
                                              "profiled_costs_s", "losses")}
                row["load"] = open("/proc/loadavg").read().split()[0]
                results["runs"][name].append(row)
                print(name, r, row["peak_activation_bytes"], f"{row['makespan_s']:.4f} s", "load", row["load"],
                      flush=True)
        results["copy"] = rate = _copy_rate()
        exact, moved = results["runs"]["exact"], results["runs"]["offload part 0"]
        results["offload_cost"] = [
            {"measured_s": m["makespan_s"] - e["makespan_s"], "predicted_s": _predicted_cost(e, rate)}
            for e, m in zip(exact, moved)]
        if args.curve:
            curves = {name: _train(extra, Path(tmp) / f"curve-{name}", stages=2, steps=args.curve)["losses"]
                      for name, extra in (("exact", []), ("bf16", CONFIGS["bf16"]))}
            results["curve"] = curves
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
