"""Issue 30's reproductions, each timed: how long it takes to end, what it says, and what it leaves behind.

Every case of the issue's list that a command line reproduces runs here as the
issue ran it, in a fresh folder, as a session of its own. A case's row gives
its wall-clock seconds (until the command's exit), its exit code, how many
lines it wrote to stderr (one is the goal for a refusal), whether any process
of its session outlived it, and how many entries it added to /dev/shm that no live process maps (what it left behind). The
table is what ``benchmarks/reliability/README.md`` holds; the guarantees are
tested one by one in the suite (this measures their time, which tests must not).

    PYTHONPATH=src python benchmarks/reliability/reproductions.py [--only NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PW = f"{shlex.quote(sys.executable)} -m pipeweave.cli"
TINY = "--model mlp --layers 4 --hidden 8 --batch 4 --microbatches 2 -s 1f1b --quiet"
HF = "--model hf:gpt2 --seq-len 16 --steps 1 --batch 4 --quiet --hf-config"

SETUP = {  # what a case needs that is not timed: a checkpoint
    "ckpt": f"{PW} train {TINY} --steps 2 --save ck --out first",
}

CASES: list[tuple[str, str, str | None]] = [
    # (name, shell command run in the case's folder, setup)
    ("plan --gpus 65536", f"{PW} plan --model gpt-1.7b --global-batch 64 --gpus 65536", None),
    ("plan --gpus 10^9", f"{PW} plan --model gpt-1.7b --global-batch 64 --gpus 1000000000", None),
    ("plan --global-batch 10^12", f"{PW} plan --model gpt-1.7b --gpus 64 --global-batch 1000000000000", None),
    (
        "plan --gpus 10^9 --global-batch 10^12",
        f"{PW} plan --model gpt-1.7b --gpus 1000000000 --global-batch 1000000000000",
        None,
    ),
    ("hf n_embd % n_head", f"{PW} train {HF} " + shlex.quote('{"n_layer":2,"n_embd":30,"n_head":4}'), None),
    ("hf activation banana", f"{PW} train {HF} " + shlex.quote('{"n_layer":2,"activation_function":"banana"}'), None),
    ("hf unknown key", f"{PW} train {HF} " + shlex.quote('{"n_layer":2,"n_embed":32}'), None),
    ("hf n_positions < --seq-len", f"{PW} train {HF} " + shlex.quote('{"n_layer":2,"n_positions":8}'), None),
    (
        'manifest "steps": "six"',
        "sed -i 's/\"steps\": 2/\"steps\": \"six\"/' ck/step-000002/manifest.json && "
        f"{PW} train {TINY} --steps 4 --resume ck/step-000002 --out second",
        "ckpt",
    ),
    (
        'manifest "steps": -5',
        "sed -i 's/\"steps\": 2/\"steps\": -5/' ck/step-000002/manifest.json && "
        f"{PW} train {TINY} --steps 4 --resume ck/step-000002 --out second",
        "ckpt",
    ),
    (
        "pipeline(split_points=2.5)",
        f"{shlex.quote(sys.executable)} -c "
        + shlex.quote(
            "import sys, torch, pipeweave\n"
            "try:\n"
            "    pipeweave.pipeline(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), "
            "(torch.zeros(2, 4),), split_points=2.5, loss=torch.nn.functional.mse_loss, dataset=[])\n"
            "except pipeweave.errors.UserError as e:\n"
            "    print(e, file=sys.stderr); sys.exit(2)"
        ),
        None,
    ),
    ("schedules --json | head -c 10", f"{PW} schedules --json | head -c 10 >/dev/null; exit ${{PIPESTATUS[0]}}", None),
    ("--zero 1 at --data-parallel 1", f"{PW} train {TINY} --steps 1 --zero 1", None),
    (
        "--tensor-parallel 64 (128 processes)",
        f"{PW} train --model gpt --heads 64 --hidden 128 --tensor-parallel 64 --steps 1 --quiet",
        None,
    ),
    ("compare --lr without --convergence", f"{PW} compare -s gpipe -D 2 -T 4 {TINY.split(' -s')[0]} --lr 0.1", None),
    ("compare --markdown /nonexistent/dir/x.md", f"{PW} compare -s gpipe -D 2 -T 4 --markdown /nonexistent/dir/x.md", None),
    ("--resume with another --seed", f"{PW} train {TINY} --steps 4 --resume ck/step-000002 --seed 3 --out second", "ckpt"),
    ("--resume with another --batch", f"{PW} train {TINY} --steps 4 --resume ck/step-000002 --batch 8 --out second", "ckpt"),
]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _mapped() -> set[str]:
    """The /dev/shm entries some live process maps (another job's, on a shared host)."""
    names: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line)
        except OSError:
            continue
    return names


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_case(name: str, command: str, setup: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pw-repro-") as folder:
        if setup is not None:
            subprocess.run(SETUP[setup], shell=True, cwd=folder, check=True, capture_output=True)
        before = _shm()
        start = time.perf_counter()
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        seconds = time.perf_counter() - start
        time.sleep(0.5)  # what a clean exit leaves must be gone by now
        left = _alive(proc.pid)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
        lines = [line for line in err.splitlines() if line.strip()]
        return {
            "case": name,
            "seconds": round(seconds, 2),
            "exit": proc.returncode,
            "stderr_lines": len(lines),
            "said": lines[-1][:160] if lines else "",
            "processes_left": left,
            "shm_left": len(_shm() - before - _mapped()),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="run only the cases whose name contains one of these words")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = []
    print(f"load average before: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    for name, command, setup in CASES:
        if args.only and not any(word in name for word in args.only):
            continue
        row = run_case(name, command, setup)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    print("\n| case | seconds | exit | stderr lines | processes left | /dev/shm left | the last line |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        said = r["said"].replace("|", "\\|")
        print(
            f"| {r['case']} | {r['seconds']:.1f} | {r['exit']} | {r['stderr_lines']} | "
            f"{'yes' if r['processes_left'] else 'no'} | {r['shm_left']} | {said} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
