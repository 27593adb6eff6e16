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
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import analyse  # noqa: E402 - found through the sys.path entry above
import procs  # noqa: E402 - found through the sys.path entry above

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--model", "gpt", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "64", "--batch", "8"]


def train_args(ranks: int, steps: int) -> list[str]:
    """The training the soak runs, without its outputs."""
    return [*MODEL, "--stages", str(ranks), "--microbatches", str(2 * ranks), "--steps", str(steps)]


def outputs(work: Path, save_every: int, resume: bool) -> list[str]:
    """Checkpoints, TensorBoard and the record, all under ``work``."""
    extra = ["--resume", "auto"] if resume else []
    return [
        *["--save", str(work / "ck"), "--save-every", str(save_every), *extra],
        *["--log-dir", str(work / "tb"), "--out", str(work / "out"), "--json", str(work / "record.json"), "--quiet"],
    ]


def probe_step_s(ranks: int, work: Path) -> float:
    """Median step time of a short run of the same training (sets the step count of a timed run)."""
    record = work / "probe.json"
    command = [sys.executable, "-m", "pipeweave.cli", "train", *train_args(ranks, 40), "--quiet"]
    subprocess.run([*command, "--out", str(work / "probe"), "--json", str(record)], check=True, cwd=work)
    times = json.loads(record.read_text())["step_times_s"][5:]
    return sorted(times)[len(times) // 2]


def machine() -> dict[str, object]:
    """What ran the soak: cores, CPU, memory, load, versions, commit."""
    import torch

    cpuinfo, meminfo = Path("/proc/cpuinfo").read_text(), Path("/proc/meminfo").read_text()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    memory = next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(int(memory) / 2**20, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit + (" (src modified)" if dirty.strip() else ""),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_at_start": os.getloadavg(),
    }


class Sampler:
    """Samples the tree below one launcher into CSV rows."""

    def __init__(self, launcher: subprocess.Popen[bytes], began: float) -> None:
        self.launcher, self.began = launcher, began
        self.rows: list[dict[str, object]] = []
        self.seen: set[int] = set()
        self.shm_before = sum(procs.shm_listing().values())
        self.current: dict[int, str] = {}

    def sample(self) -> None:
        pids = procs.descendants(self.launcher.pid)
        self.current = procs.labels(self.launcher.pid, pids)
        self.seen.update(pids)
        t = round(time.time() - self.began, 2)
        found = [s for pid, label in self.current.items() if (s := procs.sample(pid, label)) is not None]
        for s in found:
            self.rows.append({"t_s": t, "process": s.label, "pid": s.pid, "rss_bytes": s.rss_bytes, "fds": s.fds})
            self.rows[-1]["threads"] = s.threads
        held, files = procs.shm_bytes(pids)
        self.rows.append(
            {
                **{"t_s": t, "process": "run", "pid": self.launcher.pid},
                **{"rss_bytes": sum(s.rss_bytes for s in found), "fds": sum(s.fds for s in found)},
                **{"threads": sum(s.threads for s in found), "shm_bytes": held, "shm_files": files},
                "shm_delta_bytes": sum(procs.shm_listing().values()) - self.shm_before,
            }
        )

    def pid_of(self, label: str) -> int | None:
        return next((pid for pid, name in self.current.items() if name == label), None)

    def add_steps(self, events: list[analyse.StepEvent]) -> None:
        """Fill the run rows' ``step`` and ``step_time_s`` from the logged steps."""
        previous = -math.inf
        for row in (r for r in self.rows if r["process"] == "run"):
            now = self.began + float(row["t_s"])
            inside = [e for e in events if previous < e.wall <= now]
            done = [e.step for e in events if e.wall <= now]
            row["step"] = max(done) if done else ""
            row["step_time_s"] = sorted(e.seconds for e in inside)[len(inside) // 2] if inside else ""
            previous = now

    def leftovers(self) -> dict[str, object]:
        """Processes of the run still alive, and ``/dev/shm`` files named after one of its processes."""
        time.sleep(3)
        alive = sorted(pid for pid in self.seen if procs.sample(pid, "") is not None)
        names = [p.name for p in procs.shm_listing() if any(str(pid) in p.name for pid in self.seen)]
        return {"processes_alive": alive, "shm_files_named_after_the_run": names}


def watch(command: list[str], sampler_every: float, deadline_s: float, log: Path, env: dict[str, str], on_sample=None):
    """Start ``command``, sample it until it exits (SIGINT at ``deadline_s``); return the sampler and exit code."""
    began = time.time()
    launcher = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    sampler = Sampler(launcher, began)
    while launcher.poll() is None:
        sampler.sample()
        if on_sample is not None:
            on_sample(sampler)
        if time.time() - began > deadline_s:
            launcher.send_signal(signal.SIGINT)
        time.sleep(max(0.0, sampler_every - (time.time() - began) % sampler_every))
    return sampler, launcher.wait()


def write_results(name: str, out: Path, sampler: Sampler, args: argparse.Namespace, meta: dict[str, object]) -> str:
    """The CSV, table, plot and metadata of one soak; returns the table's markdown."""
    events = analyse.step_events(Path(meta["work"]) / "tb")
    sampler.add_steps(events)
    analyse.write_csv(out / f"{name}.csv", sampler.rows)
    meta["steps_logged"] = len(events)
    meta["last_step_s"] = round(events[-1].wall - sampler.began, 1) if events else None
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return summarize(out / f"{name}.csv", args, meta, events)


def summarize(csv: Path, args: argparse.Namespace, meta: dict[str, object], events=None) -> str:
    """NAME.md and NAME.png from the CSV (and the step events, else the CSV's per-sample step times)."""
    rows = analyse.read_csv(csv)
    first_step = min((float(r["t_s"]) for r in rows if r["process"] == "run" and r["step"] != ""), default=0.0)
    warmup, window = first_step + args.warmup_minutes * 60, args.window_minutes * 60
    end = meta.get("last_step_s") or float(rows[-1]["t_s"])
    found = analyse.growth(rows, warmup, end)
    work = Path(str(meta.get("work", "")))
    if events is None and (work / "tb").is_dir():
        events = analyse.step_events(work / "tb")
    if events is None:  # the CSV's per-sample medians stand in for the events
        began = 0.0
        events = [
            analyse.StepEvent(float(r["t_s"]), int(r["step"]), float(r["step_time_s"]))
            for r in rows
            if r["process"] == "run" and r["step_time_s"]
        ]
    else:
        began = float(meta["began"])
    medians = analyse.step_medians(events, began, warmup, window)
    text = analyse.table(found, medians, window, (end - warmup) / 3600)
    if "record_bytes_per_step" not in meta and (work / "out" / "trace.json").is_file():
        actions = analyse.actions_per_step(work / "out" / "trace.json")
        meta["record_actions_per_step"] = {str(r): n for r, n in actions.items()}
        meta["record_bytes_per_step"] = {str(r): analyse.record_bytes_per_step(round(n)) for r, n in actions.items()}
        meta["record_traced_steps"] = analyse.traced_steps(work / "out" / "trace.json")
        csv.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    if "record_bytes_per_step" in meta:
        text += "\n\n" + analyse.record_note(
            meta["record_bytes_per_step"], meta["record_actions_per_step"], meta.get("record_traced_steps")
        )
    heading = f"`{meta['command']}`\n\n{meta['date_utc']} UTC, commit {meta['commit']}, "
    heading += f"load average at start {meta['load_at_start'][0]:.1f}, exit code {meta.get('exit_code')}.\n\n"
    csv.with_suffix(".md").write_text(heading + text + "\n")
    analyse.plot(rows, csv.with_suffix(".png"), csv.stem, meta.get("kills_s", []))
    if args.readme:
        replace_marked(Path(args.readme), csv.stem, heading + text)
    return heading + text


def replace_marked(readme: Path, name: str, text: str) -> None:
    """Put ``text`` between ``<!-- soak:NAME -->`` and ``<!-- /soak:NAME -->`` in ``readme``."""
    page = readme.read_text()
    opening, closing = f"<!-- soak:{name} -->", f"<!-- /soak:{name} -->"
    if opening in page and closing in page:
        head, rest = page.split(opening, 1)
        readme.write_text(f"{head}{opening}\n{text}\n{closing}{rest.split(closing, 1)[1]}")


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
    deadline = 2 * args.minutes * 60 + 300
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
