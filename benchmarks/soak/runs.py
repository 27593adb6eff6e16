"""What ``soak.py run`` and ``soak.py kill`` share: the training command, the probe, the sampler of a run's
processes, and the writing of results and README sections."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
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
