"""benchmarks/soak: what it reads of a process tree, and the figures it computes from its CSV."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak"
sys.path.insert(0, str(SOAK))

import analyse  # noqa: E402 - found through the sys.path entry above
import procs  # noqa: E402 - found through the sys.path entry above
import soak  # noqa: E402 - found through the sys.path entry above

MIB = 2**20

# A child that maps 3 MiB of /dev/shm, unlinks the file (as torch does with its segments), maps it a second
# time through the descriptor it keeps, and waits.
CHILD = """
import mmap, os, sys, time
path = f"/dev/shm/pipeweave-soak-test-{os.getpid()}"
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 3 << 20)
first = mmap.mmap(fd, 3 << 20)
first[:] = b"x" * (3 << 20)
os.unlink(path)
second = mmap.mmap(fd, 1 << 20)
print("ready", flush=True)
time.sleep(30)
"""


def test_a_process_tree_is_sampled_and_an_unlinked_shared_segment_counted_once() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        tree = procs.descendants(parent.pid)
        assert len(tree) == 2 and tree[0] == parent.pid
        labels = procs.labels(parent.pid, tree)
        assert labels[parent.pid] == "launcher" and labels[tree[1]] == f"other{tree[1]}"
        child = procs.sample(tree[1], "child")
        assert child is not None and child.rss_bytes > 3 * MIB and child.threads == 1 and child.fds >= 4
        assert procs.shm_bytes(tree) == (3 * MIB, 1)  # two mappings and a descriptor: one file, its 3 MiB
        assert procs.shm_bytes([parent.pid]) == (0, 0)
    finally:
        for pid in reversed(procs.descendants(parent.pid)):
            os.kill(pid, signal.SIGKILL)
        parent.wait()
    assert procs.sample(parent.pid, "gone") is None


def _rows() -> list[dict[str, str]]:
    """A run whose rank grows 1 MiB a minute after a 50 MiB start-up jump, 10 steps a second from t = 30 s."""
    rows = []
    for t in range(0, 1200, 10):
        rss = 100 * MIB + (50 * MIB if t >= 60 else 0) + t / 60 * MIB
        step = str(10 * (t - 30)) if t >= 30 else ""
        rows.append({"t_s": str(t), "process": "rank0", "rss_bytes": str(rss), "fds": "20", "threads": "5"})
        rows.append({"t_s": str(t), "process": "run", "rss_bytes": str(rss), "fds": "20", "threads": "5"})
        rows[-1].update(shm_bytes=str(8 * MIB), shm_delta_bytes="0", step=step, step_time_s="0.1" if step else "")
    return [{key: row.get(key, "") for key in analyse.COLUMNS} for row in rows]


def test_growth_is_the_least_squares_slope_after_the_warm_up() -> None:
    found = {(g.process, g.metric): g for g in analyse.growth(_rows(), warmup_s=120, end_s=None)}
    rss = found[("rank0", "rss_bytes")]
    assert rss.per_hour == pytest.approx(60 * MIB)  # the start-up jump at 60 s is left out
    assert rss.per_1k_steps == pytest.approx(MIB / 60 / 10 * 1e3)
    assert (rss.start, rss.end) == (152 * MIB, 150 * MIB + 1190 / 60 * MIB)
    assert found[("rank0", "fds")].per_hour == 0 and found[("run", "shm_bytes")].per_hour == 0
    assert next(iter(found))[0] == "run"  # the run's totals first


def test_the_table_mode_computes_the_table_and_plot_from_a_kept_csv(tmp_path: Path) -> None:
    csv = tmp_path / "soak-x.csv"
    analyse.write_csv(csv, _rows())
    meta = {"command": "pipeweave train X", "date_utc": "D", "commit": "C", "load_at_start": [1.0], "exit_code": 0}
    csv.with_suffix(".json").write_text(json.dumps(meta))
    readme = tmp_path / "README.md"
    readme.write_text("above\n<!-- soak:soak-x -->\nold\n<!-- /soak:soak-x -->\nbelow\n")
    soak.main(["table", str(csv), "--readme", str(readme), "--warmup-minutes", "1.5", "--window-minutes", "5"])
    table = csv.with_suffix(".md").read_text()
    assert "| rank0 | rss (MiB) | 152.00 | 169.83 | 60.00 | 1.67 | 108 |" in table
    assert "median of the first 5 minutes after the warm-up: 100.0 ms" in table
    page = readme.read_text()
    assert page.startswith("above\n<!-- soak:soak-x -->\n`pipeweave train X`") and page.endswith("below\n")
    assert "old" not in page and table.strip() in page
    assert csv.with_suffix(".png").stat().st_size > 0


def test_the_record_note_says_which_steps_the_trace_kept(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    events = [{"ph": "X", "pid": r, "args": {"step": k}} for r in (0, 1) for k in range(64) for _ in range(21)]
    trace.write_text(
        json.dumps({"traceEvents": events, "otherData": {"schedule": "zb-h1", "steps": [1, 64], "of": 3000}})
    )
    assert analyse.traced_steps(trace) == [64, 3000] and analyse.actions_per_step(trace) == {0: 21.0, 1: 21.0}
    note = analyse.record_note({"0": 3600.0}, {"0": 21.0}, analyse.traced_steps(trace))
    assert note.startswith("The run's record kept every action of its first 64 steps of 3000 only")
    trace.write_text(json.dumps({"traceEvents": events, "otherData": {"schedule": "zb-h1"}}))  # an older run's
    assert analyse.traced_steps(trace) is None
    assert analyse.record_note({"0": 3600.0}, {"0": 21.0}, None).startswith("The run's record keeps every action")
