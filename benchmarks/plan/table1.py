"""Megatron-LM's Table 1 against ``pipeweave plan``: calibration on the four rows without a pipeline,
prediction of the six with one, and where each published configuration ranks in the planner's search.

    PYTHONPATH=src python benchmarks/plan/table1.py [--rows gpt-39b,gpt-1t] [--skip-search]

Prints markdown for benchmarks/plan/README.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable

from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster
from pipeweave.planner.efficiency import A100_CALIBRATED, calibrate
from pipeweave.planner.evaluate import Evaluator, Result
from pipeweave.planner.explain import parts
from pipeweave.planner.hardware import GPUS
from pipeweave.planner.memory import GIB
from pipeweave.planner.published import CALIBRATION, PREDICTION, TABLE_1, Row
from pipeweave.planner.runnable import refusal
from pipeweave.planner.search import search
from pipeweave.planner.space import Fixed, configurations

MEGATRON_2021 = ("1f1b", "interleaved-1f1b")


def evaluator(row: Row) -> Evaluator:
    cluster = Cluster(model=row.transformer, gpu=GPUS["a100-80gb"], efficiency=A100_CALIBRATED)
    return Evaluator(cluster=cluster, batch=row.batch, overlap=row.overlap_dp)


def predicted(row: Row) -> Result:
    result = evaluator(row).evaluate(row.config())
    assert result is not None
    return result


def table() -> None:
    fitted = calibrate(lambda e: ((Evaluator(cluster=Cluster(model=r.transformer, gpu=GPUS["a100-80gb"],
                                                             efficiency=e), batch=r.batch, overlap=r.overlap_dp)
                                   .evaluate(r.config()).tflops_per_gpu, r.tflops_per_gpu)  # type: ignore[union-attr]
                                  for r in CALIBRATION))
    print(f"calibrated on {[r.model for r in CALIBRATION]}: {fitted} (stored: {A100_CALIBRATED})\n")
    print("| model | TP | PP | v | GPUs | B | b | use | published TFLOP/s | predicted | error | within 10 % "
          "| bubble | memory GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in TABLE_1:
        r = predicted(row)
        error = r.tflops_per_gpu / row.tflops_per_gpu - 1
        use = "calibration" if row in CALIBRATION else "prediction"
        print(f"| {row.model} | {row.tp} | {row.pp} | {row.chunks} | {row.gpus} | {row.batch} | "
              f"{row.microbatch_size} | {use} | {row.tflops_per_gpu:.0f} | {r.tflops_per_gpu:.1f} | "
              f"{100 * error:+.1f} % | {'yes' if abs(error) <= 0.10 else 'NO'} | {r.bubble_ratio:.3f} | "
              f"{r.memory.total / GIB:.1f} |")


def rank(row: Row, space: Iterable[Config], what: str) -> None:
    ev = evaluator(row)
    started = time.perf_counter()
    plan = search(space, ev, top=10)
    seconds = time.perf_counter() - started
    mine = predicted(row)
    labels = [r.config for r in plan.best[:10]]
    place = labels.index(row.config()) + 1 if row.config() in labels else None
    best, tenth = plan.best[0], plan.best[min(9, len(plan.best) - 1)]
    where = f"#{place}" if place else (f"not in the top 10 ({100 * (mine.step_time / tenth.step_time - 1):+.1f} % "
                                         f"behind #10)")
    gap = {k: v - parts(best)[k] for k, v in parts(mine).items()}
    print(f"| {row.model} | {what} | {where} | {best.config.label} | {best.step_time:.2f} | {mine.step_time:.2f} | "
          + ", ".join(f"{k} {v:+.2f}" for k, v in gap.items())
          + f" | {mine.memory.total / GIB:.1f} | {seconds:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", help="comma list of models for the ranking (default: the six with a pipeline)")
    parser.add_argument("--skip-search", action="store_true")
    args = parser.parse_args()
    table()
    if args.skip_search:
        return
    rows = [r for r in PREDICTION if not args.rows or r.model in args.rows.split(",")]
    print("\n| model | space | published config | planner's #1 | #1 step s | published step s | "
          "published minus #1, s | published memory GiB | search |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        space = [
            c for c in configurations(row.transformer, row.gpus, row.batch, 8, Fixed()) if not refusal(c, row.transformer)
        ]  # what pipeweave train runs, as plan proposes it
        rank(row, [c for c in space if c.schedule in MEGATRON_2021 and c.recompute == "full" and c.zero == 0],
             "Megatron 2021: 1f1b/interleaved, full recompute, ZeRO 0")
        rank(row, space, "everything")


if __name__ == "__main__":
    main()
