"""Soak: a long ``pipeweave train`` run, sampled from outside, must show nothing growing.

Three modes (``python benchmarks/soak/soak.py MODE --help``):

``run``    trains a small gpt with ``pipeweave train`` on ``--ranks`` spawned
           ranks for about ``--minutes`` (the step count from a short probe run
           of the same model), saving a checkpoint about every
           ``--save-minutes`` and writing TensorBoard logs; every
           ``--sample-every`` seconds it reads every process of the run
           (``procs``): resident memory, open descriptors, threads, and the
           ``/dev/shm`` bytes the run holds. Writes ``NAME.csv`` (the samples),
           ``NAME.md`` (the table: start, end, least-squares growth per hour
           after ``--warmup-minutes`` from the first step; step-time medians of the first and last
           ``--window-minutes``), ``NAME.png`` and ``NAME.json`` (the command,
           commit, machine, load).
``kill``   the same model under ``torchrun --max-restarts`` with ``--resume
           auto``: SIGKILLs one rank at the given minutes, measures the time
           to recover, compares the final losses with an uninterrupted
           torchrun run of the same command, and the levels of every metric
           before the kill with those after the restart.
``table``  computes ``NAME.md`` and ``NAME.png`` again from a kept CSV and
           its ``NAME.json`` (and a kill run's ``NAME-restarts.md``).

With ``--readme FILE`` the table also replaces the text between
``<!-- soak:NAME -->`` and ``<!-- /soak:NAME -->`` in FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


from runs import (  # noqa: E402 - found through the sys.path entry above
    machine,
    outputs,
    probe_step_s,
    summarize,
    train_args,
    watch,
    write_results,
)


def run_mode(args: argparse.Namespace) -> None:
    name = args.name or f"soak-{args.ranks}ranks"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"pipeweave-{name}-"))
    step_s = args.step_s or probe_step_s(args.ranks, work)
    steps = args.steps or max(20, round(args.minutes * 60 / step_s))
    save_every = max(1, round(args.save_minutes * 60 / step_s))
    train = [*train_args(args.ranks, steps), *outputs(work, save_every, resume=False)]
    command = [sys.executable, "-m", "pipeweave.cli", "train", *train]
    meta = {**machine(), "work": str(work), "probe_step_s": step_s, "steps": steps, "save_every": save_every}
    meta["command"] = "pipeweave train " + " ".join(train).replace(str(work), "WORK")
    deadline = (args.deadline_minutes or 2 * args.minutes + 5) * 60
    sampler, code = watch(command, args.sample_every, deadline, work / "train.log", dict(os.environ))
    meta.update(began=sampler.began, exit_code=code, load_at_end=os.getloadavg(), **sampler.leftovers())
    meta["log_tail"] = (work / "train.log").read_text()[-2000:]
    print(write_results(name, out, sampler, args, meta))


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results folder")
    parser.add_argument("--name", help="file stem of the results (default soak-<ranks>ranks)")
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="left out of the fits, from the first step")
    parser.add_argument("--window-minutes", type=float, default=5.0, help="step-time median windows")
    parser.add_argument("--readme", help="README whose <!-- soak:NAME --> section gets the table")


def main(argv: list[str] | None = None) -> None:
    # argparse declaration
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    run = modes.add_parser("run", help="a timed run on spawned ranks, sampled")
    run.add_argument("--ranks", type=int, default=2)
    run.add_argument("--minutes", type=float, default=30.0)
    run.add_argument("--save-minutes", type=float, default=3.0, help="about this often a checkpoint")
    run.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    run.add_argument("--steps", type=int, help="steps (default: --minutes worth, from a probe run)")
    run.add_argument("--step-s", type=float, help="seconds a step takes (default: a probe run's median)")
    run.add_argument(
        "--deadline-minutes", type=float, help="SIGINT the run after this long (default 2 x --minutes + 5; raise it on a loaded machine)"
    )
    _common(run)
    kill = modes.add_parser("kill", help="under torchrun --max-restarts, one rank SIGKILLed, compared")
    kill.add_argument("--minutes", type=float, default=3.0)
    kill.add_argument("--kill-at", type=float, nargs="+", default=[1.2], help="minutes at which to kill")
    kill.add_argument("--kill-rank", type=int, default=1)
    kill.add_argument("--save-minutes", type=float, default=0.3)
    kill.add_argument("--sample-every", type=float, default=2.0)
    kill.add_argument("--step-s", type=float, help="seconds a step takes (default: a probe run's median)")
    _common(kill)
    table = modes.add_parser("table", help="NAME.md and NAME.png again from NAME.csv (and NAME.json)")
    table.add_argument("csv")
    _common(table)
    args = parser.parse_args(argv)
    if args.mode == "run":
        run_mode(args)
    elif args.mode == "kill":
        import killed

        killed.kill_mode(args)
    else:
        csv = Path(args.csv)
        meta = json.loads(csv.with_suffix(".json").read_text())
        print(summarize(csv, args, meta))
        if "kills" in meta:
            import killed

            print(killed.restart_report(csv, meta, args.readme))


if __name__ == "__main__":
    main()
