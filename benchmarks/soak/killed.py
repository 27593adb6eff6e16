"""``soak.py kill``: a rank SIGKILLed under ``torchrun --max-restarts``, the run resumed with ``--resume auto``.

The same training as ``soak.py run`` on 2 ranks, started by ``torchrun
--standalone --nproc-per-node 2 --max-restarts 3`` with ``--save DIR
--save-every K --resume auto`` (docs/guide/torchrun.md). At each of
``--kill-at`` minutes the rank ``--kill-rank`` gets SIGKILL; torchrun stops
the other rank and starts both again, and they resume the newest checkpoint.
Measured from the samples and the TensorBoard events (``NAME-restarts.md``):

- time to recover: from the kill to the first step logged after it by a
  restarted rank (and to the restarted rank's process appearing);
- the end: torchrun's exit code, and the last attempt's losses (its record's
  ``losses`` from ``first_step`` on) against those of an uninterrupted
  torchrun run of the same command, step by step;
- the levels: each process's resident memory, descriptors and threads, and
  the run's ``/dev/shm`` bytes, averaged over the minute before the first
  kill and over the last restarted run, each from ``SETTLE_S`` after its
  first step to its end, side by side;
- what is left: processes of the run alive after torchrun exits, and
  ``/dev/shm`` files named after one of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import analyse
import runs as soak  # the helpers soak.py's modes share (not soak.py: it dispatches here)

SETTLE_S = 20.0


def torchrun_command(work: Path, steps: int, save_every: int) -> list[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        raise SystemExit("torchrun not found beside this Python nor on PATH")
    launch = ["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "3"]
    train = [*soak.train_args(2, steps), *soak.outputs(work, save_every, resume=True)]
    return [torchrun, *launch, "--monitor-interval", "0.5", "-m", "pipeweave.cli", "train", *train]


class Killer:
    """Called after every sample: SIGKILLs the rank at each due time, notes when its successor appears."""

    def __init__(self, kill_at_s: list[float], rank: int) -> None:
        self.due, self.label = sorted(kill_at_s), f"rank{rank}"
        self.kills: list[dict[str, float | int]] = []

    def __call__(self, sampler: soak.Sampler) -> None:
        now = time.time() - sampler.began
        pid = sampler.pid_of(self.label)
        last = self.kills[-1] if self.kills else None
        if last is not None and "restarted_s" not in last and pid is not None and pid != last["pid"]:
            last["restarted_s"] = round(now, 2)
        if self.due and now >= self.due[0] and pid is not None and (last is None or "restarted_s" in last):
            os.kill(pid, signal.SIGKILL)
            self.kills.append({"at_s": round(time.time() - sampler.began, 2), "pid": pid})
            self.due.pop(0)


def _levels(rows: list[dict[str, str]], first: float, last: float) -> dict[tuple[str, str], float]:
    picked: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if first <= float(row["t_s"]) < last:
            for metric in analyse.METRICS:
                if row.get(metric, "") != "":
                    picked.setdefault((row["process"], metric), []).append(float(row[metric]))
    return {key: statistics.fmean(values) for key, values in picked.items()}


def _recovery(kills: list[dict], events: list[analyse.StepEvent], began: float) -> None:
    for kill in kills:
        restarted = kill.get("restarted_s", kill["at_s"])
        after = [e for e in events if e.wall - began > restarted]
        if after:
            kill["first_step_after_s"] = round(after[0].wall - began, 2)
            kill["recovered_after_s"] = round(after[0].wall - began - kill["at_s"], 2)
            kill["resumed_at_step"] = after[0].step


def _compare(killed: Path, reference: Path) -> dict[str, object]:
    if not (killed.exists() and reference.exists()):
        missing = [str(p) for p in (killed, reference) if not p.exists()]
        return {"last_attempt_first_step": -1, "steps_compared": 0, "losses_equal": False, "missing": missing}
    mine, theirs = json.loads(killed.read_text()), json.loads(reference.read_text())
    first = mine["first_step"]
    expected = theirs["losses"][first:]
    diffs = [abs(a - b) for a, b in zip(mine["losses"], expected)]
    return {
        "last_attempt_first_step": first,
        "steps_compared": len(diffs),
        "losses_equal": len(mine["losses"]) == len(expected) and max(diffs, default=0.0) == 0.0,
        "max_abs_loss_difference": max(diffs, default=0.0),
        "final_loss": mine["losses"][-1],
        "reference_final_loss": theirs["losses"][-1],
    }


def _table(meta: dict, levels: tuple[dict, dict]) -> str:
    lines = ["| kill at (s) | rank process back (s) | first step after (s) | recovered after (s) | resumed at step |"]
    lines.append("|---:|---:|---:|---:|---:|")
    for k in meta["kills"]:
        cells = [k.get(key, "-") for key in ("at_s", "restarted_s", "first_step_after_s", "recovered_after_s")]
        lines.append("| " + " | ".join(str(c) for c in [*cells, k.get("resumed_at_step", "-")]) + " |")
    c = meta["comparison"]
    lines += [
        "",
        f"torchrun exit code {meta['exit_code']}; the last attempt trained steps {c['last_attempt_first_step']} "
        f"to {meta['steps'] - 1}: {c['steps_compared']} losses, equal to the uninterrupted run's: "
        f"{c['losses_equal']} (largest difference {c.get('max_abs_loss_difference', math.nan):.3g}); final loss "
        f"{c.get('final_loss', math.nan):.6f} vs {c.get('reference_final_loss', math.nan):.6f}. Processes left: "
        f"{meta['processes_alive'] or 'none'}; /dev/shm files left: {meta['shm_files_named_after_the_run'] or 'none'}.",
        "",
        "| process | metric | before the kill | after the restart | change |",
        "|---|---|---:|---:|---:|",
    ]
    before, after = levels
    for key in sorted(set(before) & set(after), key=lambda k: (k[0] != "run", k)):
        unit = analyse.METRICS[key[1]]
        scale = {"MiB": 2**20, "ms": 1e-3}.get(unit, 1)
        b, a = before[key] / scale, after[key] / scale
        metric = f"{key[1].removesuffix('_bytes').removesuffix('_s')} ({unit})" if unit else key[1]
        lines.append(f"| {key[0]} | {metric} | {b:.1f} | {a:.1f} | {a - b:+.1f} |")
    return "\n".join(lines)


def kill_mode(args: argparse.Namespace) -> None:
    name = args.name or "soak-torchrun"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"pipeweave-{name}-"))
    step_s = args.step_s or soak.probe_step_s(2, work)
    steps = max(20, round(args.minutes * 60 / step_s))
    save_every = max(1, round(args.save_minutes * 60 / step_s))
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch/pytorch#135712 (the guide)
    killer = Killer([m * 60 for m in args.kill_at], args.kill_rank)
    runs = {}
    for attempt, hook in (("killed", killer), ("reference", None)):
        (work / attempt).mkdir()
        command = torchrun_command(work / attempt, steps, save_every)
        log = work / attempt / "torchrun.log"
        runs[attempt] = soak.watch(command, args.sample_every, 4 * args.minutes * 60 + 300, log, env, hook)
    sampler, code = runs["killed"]
    train = " ".join(command[command.index("train") + 1 :]).replace(str(work / "reference"), "WORK")
    meta = {**soak.machine(), "work": str(work / "killed"), "probe_step_s": step_s, "steps": steps}
    meta.update(save_every=save_every, began=sampler.began, exit_code=code, reference_exit_code=runs["reference"][1])
    meta["command"] = "torchrun " + " ".join(command[1 : command.index("train")]) + " train " + train
    meta.update(kills=killer.kills, kills_s=[k["at_s"] for k in killer.kills], **sampler.leftovers())
    events = analyse.step_events(work / "killed" / "tb")
    _recovery(killer.kills, events, sampler.began)
    meta["comparison"] = _compare(work / "killed" / "record.json", work / "reference" / "record.json")
    soak.write_results(name, out, sampler, args, meta)
    print(restart_report(out / f"{name}.csv", meta, args.readme))


def restart_report(csv: Path, meta: dict, readme: str | None) -> str:
    """NAME-restarts.md from NAME.csv and the kills, recovery and comparison in ``meta``; returns its text."""
    rows = analyse.read_csv(csv)
    kills = meta["kills"]
    recovered = max(k.get("first_step_after_s", k["at_s"]) for k in kills) + SETTLE_S
    first_step = min(float(r["t_s"]) for r in rows if r["process"] == "run" and r["step"] != "")
    before = _levels(rows, max(kills[0]["at_s"] - 60, first_step + SETTLE_S), kills[0]["at_s"])
    heading = f"`{meta['command']}`\n\n{meta['date_utc']} UTC, commit {meta['commit']}, "
    heading += f"load average at start {meta['load_at_start'][0]:.1f}.\n\n"
    text = heading + _table(meta, (before, _levels(rows, recovered, meta["last_step_s"])))
    name = f"{csv.stem}-restarts"
    csv.with_name(f"{name}.md").write_text(text + "\n")
    if readme:
        soak.replace_marked(Path(readme), name, text)
    return text
