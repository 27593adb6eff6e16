"""Pictures: PNG/SVG plots, Chrome traces and the text timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeweave.errors import UserError
from pipeweave.schedule import generate
from pipeweave.sim import CostModel, simulate
from pipeweave.sim.plot import plot_timeline
from pipeweave.sim.textline import format_timeline
from pipeweave.sim.trace import chrome_trace, write_trace


@pytest.mark.parametrize("suffix", [".png", ".svg"])
@pytest.mark.parametrize("name", ["1f1b", "zb-v", "chimera"])
def test_plot_is_written(tmp_path: Path, name: str, suffix: str) -> None:
    timeline = simulate(generate(name, num_stages=4, num_microbatches=8))
    path = plot_timeline(timeline, tmp_path / f"t{suffix}")
    data = path.read_bytes()
    assert len(data) > 5000
    if suffix == ".png":
        assert data.startswith(b"\x89PNG")
    else:
        text = data.decode()
        assert "<svg" in text and f"{name}" in text  # the title names the schedule


def test_plot_of_a_big_schedule(tmp_path: Path) -> None:
    path = plot_timeline(simulate(generate("1f1b", num_stages=16, num_microbatches=128)), tmp_path / "big.png")
    assert path.stat().st_size > 5000


def test_plot_rejects_unknown_formats(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"\.png, \.svg or \.pdf"):
        plot_timeline(simulate(generate("1f1b", num_stages=2, num_microbatches=2)), tmp_path / "t.gif")


def test_trace_has_one_event_per_action(tmp_path: Path) -> None:
    timeline = simulate(generate("zb-h1", num_stages=3, num_microbatches=5), CostModel(f=2, b=1, w=1))
    path = write_trace(timeline, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    actions = [e for row in timeline.events for e in row]
    assert len(events) == len(actions)
    by_name = {ev["name"]: ev for ev in events}
    for rank, row in enumerate(timeline.events):
        for e in row:
            ev = by_name[str(e.action)]
            assert ev["pid"] == rank and ev["cat"] == e.action.op.value
            assert ev["ts"] == e.start * 1000 and ev["dur"] == (e.end - e.start) * 1000
            assert ev["args"] == {"stage": e.action.stage, "microbatch": e.action.microbatch, "op": e.action.op.value}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 2"}


def test_trace_scale() -> None:
    trace = chrome_trace(simulate(generate("gpipe", num_stages=1, num_microbatches=1)), us_per_unit=1.0)
    assert [(e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"] == [
        ("0F0", 0.0, 1.0),
        ("0B0", 1.0, 2.0),
        ("0U0", 3.0, 0.0),
    ]


def test_text_timeline_is_time_aligned() -> None:
    # 1F1B, D=2, T=2, f = b = w = 1 (B lasts 2), makespan 9: in 32 columns, 3 per unit.
    #   rank 0: F0 [0,1] F1 [1,2] idle [2,4] B0 [4,6] idle [6,7] B1 [7,9]
    #   rank 1: idle [0,1] F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] idle [7,9]
    text = format_timeline(simulate(generate("1f1b", num_stages=2, num_microbatches=2)), width=40)
    lines = text.splitlines()
    assert lines[0] == "rank 0 |F0 F1 ......B0    ...B1    "
    assert lines[1] == "rank 1 |...F0 B0    F1 B1    ......"
    assert lines[2] == "legend: F forward, B backward, . idle, 1 column = 0.333 time units"


def test_text_timeline_fits_and_elides_ranks() -> None:
    text = format_timeline(simulate(generate("1f1b", num_stages=64, num_microbatches=512)), width=100)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines[:-1])
    assert len(lines) == 32 + 2  # 16 first ranks, "...", 16 last ranks, legend
    assert lines[0].startswith("rank 0 ") and lines[-2].startswith("rank 63")


def test_text_timeline_marks_later_chunks_in_lower_case() -> None:
    text = format_timeline(simulate(generate("zb-v", num_stages=2, num_microbatches=4)))
    assert "f" in text.splitlines()[0] and "lower case" in text.splitlines()[-1]
