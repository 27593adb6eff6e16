"""The soak's figures from its samples: growth per hour by least squares, step times, the table and the plot.

Everything here reads the CSV ``soak.py`` writes (and the run's TensorBoard
events for step times), so a table can be computed again from a kept CSV:
``python benchmarks/soak/soak.py table results/soak-2ranks.csv``.

CSV columns: ``t_s`` (seconds since the launcher started), ``process`` (a
label of ``procs.labels``, or ``run`` for the run as a whole), ``pid``,
``rss_bytes``, ``fds``, ``threads``, and on ``run`` rows also
``shm_bytes``/``shm_files`` (``/dev/shm`` files the run's processes hold),
``shm_delta_bytes`` (all of ``/dev/shm`` against its size when the soak
began: other users of the machine show here too), ``step`` (the last step
logged so far) and ``step_time_s`` (the median step time logged since the
previous sample).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

COLUMNS = [
    "t_s",
    "process",
    "pid",
    "rss_bytes",
    "fds",
    "threads",
    "shm_bytes",
    "shm_files",
    "shm_delta_bytes",
    "step",
    "step_time_s",
]
METRICS = {
    "rss_bytes": "MiB",
    "fds": "",
    "threads": "",
    "shm_bytes": "MiB",
    "shm_delta_bytes": "MiB",
    "step_time_s": "ms",
}


@dataclass
class StepEvent:
    """One step's ``train/step_time_s`` as the run's TensorBoard events hold it."""

    wall: float
    step: int
    seconds: float


def step_events(log_dir: Path) -> list[StepEvent]:
    """Every ``train/step_time_s`` scalar in the event files under ``log_dir``, in order of wall time."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found: list[StepEvent] = []
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "train/step_time_s":
                    seconds = value.simple_value if value.HasField("simple_value") else value.tensor.float_val[0]
                    found.append(StepEvent(event.wall_time, event.step, float(seconds)))
    return sorted(found, key=lambda e: e.wall)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


def write_csv(path: Path, rows: list[dict[str, object]]) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two distinct x)."""
    if len(points) < 2:
        return 0.0
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def series(rows: list[dict[str, str]], process: str, metric: str) -> list[tuple[float, float]]:
    """``(t_s, value)`` of one process's metric, where sampled."""
    return [(float(r["t_s"]), float(r[metric])) for r in rows if r["process"] == process and r.get(metric, "") != ""]


def _scaled(value: float, unit: str) -> str:
    if unit == "MiB":
        return f"{value / 2**20:.2f}"
    if unit == "ms":
        return f"{value * 1e3:.1f}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


@dataclass
class Growth:
    """One metric of one process over the measured window."""

    process: str
    metric: str
    start: float
    end: float
    per_hour: float
    per_1k_steps: float
    """The growth per hour over the steps trained per hour (NaN where the CSV has no steps)."""
    samples: int


def growth(rows: list[dict[str, str]], warmup_s: float, end_s: float | None) -> list[Growth]:
    """Each process's and the run's metrics from ``warmup_s`` to ``end_s`` (the last step; None: the last sample)."""
    processes = sorted({r["process"] for r in rows}, key=lambda p: (p != "run", p))

    def window(process: str, metric: str) -> list[tuple[float, float]]:
        return [(t, v) for t, v in series(rows, process, metric) if t >= warmup_s and (end_s is None or t <= end_s)]

    steps_per_s = slope(window("run", "step")) or float("nan")
    found: list[Growth] = []
    for process in processes:
        for metric in METRICS:
            points = window(process, metric)
            if len(points) < 2:
                continue
            per_s = slope(points)
            found.append(
                Growth(
                    process, metric, points[0][1], points[-1][1], per_s * 3600, per_s / steps_per_s * 1e3, len(points)
                )
            )
    return found


def step_medians(events: list[StepEvent], began: float, warmup_s: float, window_s: float) -> tuple[float, float]:
    """Median step time of the first ``window_s`` from ``warmup_s`` (seconds after ``began``) and of the last
    ``window_s`` of steps."""
    if not events:
        return float("nan"), float("nan")
    first = [e.seconds for e in events if warmup_s <= e.wall - began < warmup_s + window_s]
    last_wall = events[-1].wall
    last = [e.seconds for e in events if e.wall > last_wall - window_s]
    return (statistics.median(first) if first else float("nan")), statistics.median(last)


def table(found: list[Growth], medians: tuple[float, float], window_s: float, hours: float) -> str:
    """The markdown table of ``found`` and the step-time medians."""
    lines = [
        "| process | metric | start | end | growth per hour | per 1000 steps | samples |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for g in found:
        unit = METRICS[g.metric]
        name = f"{g.metric.removesuffix('_bytes').removesuffix('_s')} ({unit})" if unit else g.metric
        rate = _scaled(g.per_hour, unit) if unit else f"{g.per_hour:.2f}"
        per_steps = _scaled(g.per_1k_steps, unit) if unit else f"{g.per_1k_steps:.3f}"
        cells = [g.process, name, _scaled(g.start, unit), _scaled(g.end, unit), rate, per_steps, str(g.samples)]
        lines.append("| " + " | ".join(cells) + " |")
    minutes = window_s / 60
    lines += [
        "",
        f"Step time, median of the first {minutes:g} minutes after the warm-up: {medians[0] * 1e3:.1f} ms; "
        f"of the last {minutes:g} minutes: {medians[1] * 1e3:.1f} ms "
        f"({(medians[1] / medians[0] - 1) * 100:+.0f} %). Measured window: {hours * 60:.1f} minutes.",
    ]
    return "\n".join(lines)


def plot(rows: list[dict[str, str]], path: Path, title: str, marks: list[float] = ()) -> None:
    """RSS, descriptors and threads per process, ``/dev/shm`` and step time, over minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rss_bytes", "resident MiB", 2**20, False),
        ("rss_change", "resident MiB, change\nsince the first step", 2**20, False),
        ("fds", "open descriptors", 1, False),
        ("threads", "threads", 1, False),
        ("shm_bytes", "/dev/shm MiB held", 2**20, True),
        ("step_time_s", "step time ms (median per sample)", 1e-3, True),
    ]
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 * len(panels)), sharex=True)
    processes = sorted({r["process"] for r in rows if r["process"] != "run"})
    stepped = [(float(r["t_s"]), int(r["step"])) for r in rows if r["process"] == "run" and r["step"] != ""]
    first_step = min((t for t, _ in stepped), default=0.0)
    last_step = min((t for t, step in stepped if step == max(s for _, s in stepped)), default=math.inf)
    for axis, (metric, label, scale, run_only) in zip(axes, panels):
        for process in ["run"] if run_only else processes:
            if metric == "rss_change":
                points = [(t, v) for t, v in series(rows, process, "rss_bytes") if first_step <= t <= last_step]
                points = [(t, v - points[0][1]) for t, v in points] if points else []
            else:
                points = series(rows, process, metric)
            if points:
                axis.plot([t / 60 for t, _ in points], [v / scale for _, v in points], label=process, lw=1)
        for mark in marks:
            axis.axvline(mark / 60, color="red", lw=0.8, ls="--")
        axis.set_ylabel(label, fontsize=8)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=4)
    axes[0].set_title(title, fontsize=9)
    axes[-1].set_xlabel("minutes since start")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def actions_per_step(trace: Path) -> dict[int, float]:
    """Per rank, the actions it recorded in a step, from the run's Chrome trace (``train --trace``)."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = 1 + max((e["args"]["step"] for e in events), default=0)
    counts: dict[int, int] = {}
    for e in events:
        counts[e["pid"]] = counts.get(e["pid"], 0) + 1
    return {rank: n / steps for rank, n in sorted(counts.items())}


def record_bytes_per_step(actions: int, steps: int = 2000) -> float:
    """Python heap bytes a step of ``actions`` actions adds to a ``RankRecord`` (``records`` rows and
    ``action_cpu_s``, as ``runtime.run.job`` appends them), measured with tracemalloc on rows of the same shape."""
    import random
    import tracemalloc

    ops = ["F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]  # interned, as Op values are
    records: list[list[tuple[int, str, int, float, float]]] = []
    cpu: list[list[float]] = []
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(steps):
        records.append([(0, random.choice(ops), j, random.random(), random.random()) for j in range(actions)])
        cpu.append([random.random() for _ in range(actions)])
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return grown / steps


def traced_steps(trace: Path) -> list[int] | None:
    """The steps the run's Chrome trace kept, ``[kept, of]`` (its ``otherData``); None from a run at a commit
    that kept every step without saying so."""
    other = json.loads(trace.read_text()).get("otherData", {})
    return [other["steps"][1], other["of"]] if "of" in other else None


def record_note(per_rank: dict[str, float], actions: dict[str, float], traced: list[int] | None = None) -> str:
    """One sentence: what the run's record adds per step on each rank (``traced``: ``traced_steps``)."""
    cells = [
        f"rank {r}: {actions[r]:.0f} actions, {per_rank[r] / 1024:.1f} KiB ({per_rank[r] * 1e3 / 2**20:.1f} MiB "
        "per 1000 steps)"
        for r in sorted(per_rank)
    ]
    rows = "rows of the same shape take, per step, by tracemalloc: " + "; ".join(cells) + "."
    if traced is not None and traced[0] < traced[1]:
        return (
            f"The run's record kept every action of its first {traced[0]} steps of {traced[1]} only "
            f"(`--trace-steps`; beyond them a step's loss, CPU time and end); had it kept every step, {rows}"
        )
    return (
        "The run's record keeps every action of every step for its trace (`RankRecord.records` and "
        f"`action_cpu_s`); {rows}"
    )
