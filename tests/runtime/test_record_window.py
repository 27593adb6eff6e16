"""A run longer than ``--trace-steps`` keeps every action of its first steps only, and every step's loss and time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from config_defaults import train_config

import pipeweave
from pipeweave.commands.train_report import print_summary
from pipeweave.models import ModelSpec


def test_a_long_run_keeps_the_window_of_actions_and_every_step(tmp_path: Path) -> None:
    steps, window = 7, 3
    config = train_config(
        schedule="zb-h1",
        num_stages=2,
        num_microbatches=2,
        batch_size=4,
        steps=steps,
        model=ModelSpec(kind="mlp", layers=2, hidden=8),
        trace_steps=window,
        quiet=True,
        out=str(tmp_path),
        transport="gloo",
    )
    record = pipeweave.train(config)
    for rank in record.ranks:  # the rows of the window only; every step's loss, CPU time and end
        assert len(rank.records) == len(rank.action_cpu_s) == window
        assert len(rank.losses) == len(rank.step_cpu_s) == len(rank.step_ends) == steps
        assert [row[-1][4] for row in rank.records] == rank.step_ends[:window]
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["traced_steps"] == window and len(report["losses"]) == steps
    ends = [max(r.step_ends[k] for r in record.ranks) for k in range(steps)]
    assert report["step_times_s"][1:] == pytest.approx([b - a for a, b in zip(ends, ends[1:])])
    assert all(t > 0 for t in report["step_times_s"])
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"} == set(range(window))
    assert trace["otherData"]["steps"] == [1, window] and trace["otherData"]["of"] == steps
    assert 0 <= report["bubble_ratio"] < 1 and report["profiled_costs_s"]["f"][0] > 0


def test_the_summary_says_which_steps_the_trace_covers(capsys: pytest.CaptureFixture[str]) -> None:
    report = {
        "schedule": "1f1b",
        "stages": 2,
        "microbatches": 2,
        "steps": 12376,
        "traced_steps": 64,
        "transport": "shm",
        "model": {"entry": None, "kind": "mlp"},
        "losses": [1.0, 0.5],
        "step_time_s": 0.1,
        "makespan_simulated_s": 0.1,
        "samples_per_s": 80.0,
        "bubble_ratio": 0.2,
        "bubble_ratio_simulated": 0.2,
        "bubble_ratio_flush": 0.2,
        "bubble_ratio_flush_simulated": 0.2,
        "profiled_costs_s": {"dispatch": 1e-5},
        "bubble_ratio_simulated_no_dispatch": 0.1,
        "peak_activation_bytes": [1, 1],
        "weight_bytes": [1, 1],
    }
    print_summary(report, {})
    assert "trace: steps 1-64 of 12376" in capsys.readouterr().out
    print_summary({**report, "traced_steps": 12376}, {})
    assert "trace:" not in capsys.readouterr().out
