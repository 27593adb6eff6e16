"""How long a run takes to clear after its launcher is killed by SIGKILL: every process gone, /dev/shm clean.

Per round: start ``pipeweave train`` (the tiny mlp, ``--ranks`` stage ranks,
shared-memory rings: ``--transport shm``) in a session of its own, wait until
every rank has trained a few steps (a step log line per step), note every
process below the launcher (its fork server, resource tracker and ranks) and
the /dev/shm entries they have mapped (named semaphores), SIGKILL the launcher and
poll every 5 ms until none of those processes is alive (a zombie counts as
gone) and none of those entries is left. Prints one JSON object per round and
the medians per rank count.

    PYTHONPATH=src python benchmarks/cleanup/killed_launcher.py --ranks 2 4 --rounds 5 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from processes import descendants  # noqa: E402 - the suite's view of a run's processes

SHM = Path("/dev/shm")


def command(ranks: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeweave.cli",
        "train",
        "--model",
        "mlp",
        "--layers",
        str(2 * ranks),
        "--hidden",
        "32",
        "--batch",
        "16",
        "--microbatches",
        "4",
        "-s",
        "1f1b",
        "--stages",
        str(ranks),
        "--steps",
        "1000000",
        "--transport",
        "shm",
        "--quiet",
        "--out",
        str(out),
    ]


def shm_entries(pids: set[int]) -> set[str]:
    """The /dev/shm entries (named semaphores, segments) that ``pids`` have mapped and that still have a name."""
    entries: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                entries.add(path[len("/dev/shm/") :])
    return entries


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def one_round(ranks: int, warm_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            command(ranks, Path(tmp)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if len(descendants(proc.pid)) >= ranks + 2:  # fork server, resource tracker, ranks
                break
            time.sleep(0.05)
        time.sleep(warm_s)  # past the process group's start: in the training loop
        seen = descendants(proc.pid)
        helpers = {p for p, parent in seen.items() if parent == proc.pid}  # the fork server, the resource tracker
        entries = shm_entries({proc.pid, *seen})
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        gone: dict[int, float] = {}
        shm_s = None
        while time.monotonic() - killed < 60:
            now = time.monotonic() - killed
            gone.update({p: now for p in seen if p not in gone and not alive(p)})
            if shm_s is None and not entries & set(os.listdir(SHM)):
                shm_s = now
            if len(gone) == len(seen) and shm_s is not None:
                break
            time.sleep(0.005)
        for p in seen:  # a failed round leaves nothing either
            if alive(p):
                os.kill(p, signal.SIGKILL)
    ranks_s = [gone.get(p, -1.0) for p in seen if p not in helpers]
    return {
        "ranks": ranks,
        "processes": len(seen),
        "shm_entries": len(entries),
        "ranks_gone_s": round(max(ranks_s), 3),
        "helpers_gone_s": [round(gone.get(p, -1.0), 3) for p in sorted(helpers)],
        "processes_gone_s": round(max(gone.values()), 3) if len(gone) == len(seen) else -1.0,
        "shm_clean_s": round(shm_s, 3) if shm_s is not None else -1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm", type=float, default=3.0, help="seconds of training before the kill")
    parser.add_argument("--json", type=Path, help="also write the rounds and medians here")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    results: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for ranks in args.ranks:
            row = one_round(ranks, args.warm)
            print(json.dumps(row), flush=True)
            results.append(row)
    summary = []
    for ranks in args.ranks:
        rows = [r for r in results if r["ranks"] == ranks]
        summary.append(
            {
                "ranks": ranks,
                "rounds": len(rows),
                "median_processes_gone_s": statistics.median(r["processes_gone_s"] for r in rows),
                "max_processes_gone_s": max(r["processes_gone_s"] for r in rows),
                "median_ranks_gone_s": statistics.median(r["ranks_gone_s"] for r in rows),
                "median_shm_clean_s": statistics.median(r["shm_clean_s"] for r in rows),
            }
        )
        print(json.dumps(summary[-1]))
    if args.json is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        load = {"start": load_before, "end": os.getloadavg()[0], "cpus": os.cpu_count()}
        record = {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": load}
        args.json.write_text(json.dumps({**record, "summary": summary, "rounds": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
