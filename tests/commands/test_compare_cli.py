"""``pipeweave compare``: each column is what simulate, train or the reference executor gives for that approach alone."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeweave.cli import main
from pipeweave.commands import compare_measure
from pipeweave.commands.compare_table import classify, pareto, recommend, seed_summary
from pipeweave.commands.convergence import ADAPTIVE_LR, OPTIMIZER_ROWS, Setting, evaluate, final_parameters
from pipeweave.commands.units import memory_bytes
from pipeweave.models import ModelSpec
from pipeweave.partition import LayerCosts
from pipeweave.runtime.reference import run_reference
from pipeweave.schedule import generate
from pipeweave.schedule.registry import SCHEDULES
from pipeweave.weights.optimizers import AdaBelief

# A residual mlp of 8 blocks with uneven, made-up per-layer costs (no profiling in these tests), exact in
# binary so that per-part sums are the same however they are added.
MODEL = ["--model", "mlp", "--layers", "8", "--hidden", "8"]
F = (1.0, 2.0, 1.5, 1.0, 1.0, 3.0, 1.0, 2.0)


@pytest.fixture
def costs(tmp_path: Path) -> str:
    layers = replace(
        LayerCosts.uniform(8),
        forward=F,
        input_grad=tuple(2.0 * f for f in F),
        weight_grad=tuple(0.5 * f for f in F),
        activation=(100.0,) * 8,
    )
    path = tmp_path / "costs.json"
    layers.save(path)
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return dict(json.loads(capsys.readouterr().out))


def part_times(num_parts: int) -> dict[str, str]:
    """Per-part F, I, W of ``F`` cut uniformly, summed here by hand (8 layers: 2 per part, or 1)."""
    size = 8 // num_parts
    sums = [sum(F[p * size : (p + 1) * size]) for p in range(num_parts)]
    return {k: ",".join(repr(s * scale) for s in sums) for k, scale in (("f", 1.0), ("b", 2.0), ("w", 0.5))}


APPROACHES = ("gpipe", "zb-h1", "interleaved-1f1b", "chimera", "pipedream", "pipemare", "wpipe")


def test_simulated_columns_equal_simulate_alone(capsys: pytest.CaptureFixture[str], costs: str) -> None:
    out = run_json(
        capsys, ["compare", "-s", ",".join(APPROACHES), "-D", "2", "-T", "4", *MODEL, "--costs", costs, "--json"]
    )
    rows = {r["name"]: r for r in out["approaches"]}
    assert list(rows) == [n for n in SCHEDULES if n in APPROACHES]
    listed = {e["name"]: e for e in run_json(capsys, ["schedules", "--json"])["schedules"]}
    for name, row in rows.items():
        info = SCHEDULES[name]
        times = part_times(2 * (info.chunks or 2))
        argv = ["simulate", "-s", name, "-D", "2", "-T", "4", "--json", *(f"--time-{k}={v}" for k, v in times.items())]
        argv += ["--chunks", "2"] if info.chunks is None else []
        argv += [] if info.synchronous else ["--steps", "8"]
        alone = run_json(capsys, argv)
        bubble = alone["bubble_ratio"] if info.synchronous else alone["steady_bubble_ratio"]
        assert row["bubble_ratio"] == bubble, name
        for key in ("bubble_ratio_flush", "peak_activations", "weight_versions", "staleness", "inconsistency"):
            assert row[key] == alone[key], (name, key)
        assert "tied_lag" not in row  # an untied model
        if info.synchronous:
            assert row["step_time_s"] == alone["makespan"] and row["samples_per_s"] == 16 / alone["makespan"]
        assert (row["closed_bubble"], row["closed_activations"], row["closed_weights"]) == (
            listed[name]["bubble"],
            listed[name]["activations"],
            listed[name]["weights"],
        )
    assert rows["gpipe"]["lit_bubble_value"] == pytest.approx(1 / 5)  # (D-1)/(T+D-1) at D = 2, T = 4
    assert rows["pipedream"]["lit_convergence"] == "good"


def test_a_tied_model_shows_the_tied_lag_beside_the_staleness_of_the_streams_that_train_it(
    capsys: pytest.CaptureFixture[str], costs: str, cli_error: Any
) -> None:
    """The gpt with --tie-embeddings (8 layers, as the costs): each tied stream's staleness and tied lag are
    ``simulate --tied``'s, a synchronous row has no lag, a stream that cannot train the tie is skipped."""
    tied = ["--model", "gpt", "--layers", "6", "--hidden", "8", "--heads", "2", "--tie-embeddings", "--costs", costs]
    argv = ["compare", "-D", "2", "-T", "4", *tied]
    out = run_json(capsys, [*argv, "-s", "1f1b,pipedream,pipedream-2bw,ampnet", "--json"])
    rows = {r["name"]: r for r in out["approaches"]}
    assert "tied_lag" not in rows["1f1b"] and rows["1f1b"]["staleness"] == [0, 0]
    times = part_times(2)
    for name in ("pipedream", "pipedream-2bw", "ampnet"):
        alone = run_json(
            capsys,
            [
                "simulate",
                "-s",
                name,
                "-D",
                "2",
                "-T",
                "4",
                "--steps",
                "8",
                "--tied",
                "--json",
                *(f"--time-{k}={v}" for k, v in times.items()),
            ],
        )
        assert rows[name]["tied_lag"] == alone["tied_lag"] == [0, 2 if name != "pipedream-2bw" else 1], name
        assert rows[name]["staleness"] == alone["staleness"], name
    table = main_text(capsys, [*argv, "-s", "1f1b,pipedream"])
    assert "tied lag" in table and "tied lag" not in main_text(capsys, [*argv[:5], *MODEL, "--costs", costs])
    assert {e["name"] for e in run_json(capsys, [*argv, "--json"])["skipped"]} >= {"pipemare", "avgpipe"}
    assert "train on the asynchronous pipedream-2bw, pipedream, ampnet only, not pipemare" in cli_error(
        [*argv, "-s", "pipemare"]
    )
    from pipeweave.cli import build_parser

    assert "--tie-embeddings" in compare_measure.train_argv("pipedream", build_parser().parse_args(argv), Path("x"))


def main_text(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_convergence_columns_equal_the_reference_executor(capsys: pytest.CaptureFixture[str], costs: str) -> None:
    out = run_json(
        capsys,
        [
            "compare",
            "-s",
            "1f1b,pipedream",
            "-D",
            "2",
            "-T",
            "2",
            "--batch",
            "4",
            *MODEL,
            "--costs",
            costs,
            "--convergence",
            "3",
            "--seeds",
            "2",
            "--lr",
            "0.05",
            "--json",
        ],
    )
    rows = {r["name"]: r for r in out["approaches"]}
    spec = ModelSpec(kind="mlp", layers=8, hidden=8)
    losses: dict[str, list[float]] = {}
    for name, schedule in (
        ("1f1b", generate("1f1b", num_stages=2, num_microbatches=2)),
        ("pipedream", generate("pipedream", num_stages=2, num_microbatches=2, num_steps=3)),
    ):
        for seed in (0, 1):
            seeded = replace(spec, seed=seed)
            result = run_reference(
                schedule,
                seeded,
                steps=3,
                batch_size=4,
                seed=seed,
                optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            )
            setting = Setting(spec=seeded, batch_size=4, steps=3, lr=0.05)
            losses.setdefault(name, []).append(evaluate(setting, final_parameters(result.stage_parameters)))
    assert rows["1f1b"]["convergence_eval_loss"] == losses["1f1b"]
    assert rows["pipedream"]["convergence_eval_loss"] == losses["pipedream"]
    relative = [p / s - 1 for p, s in zip(losses["pipedream"], losses["1f1b"])]
    assert rows["pipedream"]["convergence_relative"] == relative
    assert rows["pipedream"]["convergence_mean"] == sum(relative) / 2
    assert rows["1f1b"]["convergence_class"] == "excellent"


def test_predicting_approaches_gain_a_convergence_row_per_optimizer(
    capsys: pytest.CaptureFixture[str], costs: str
) -> None:
    """XGrad: xpipe+adabelief (and each other optimizer) is XPipe trained with it, relative to 1f1b with it."""
    argv = ["compare", "-s", "1f1b,xpipe", "-D", "2", "-T", "2", "--batch", "4", *MODEL, "--costs", costs]
    out = run_json(capsys, [*argv, "--convergence", "3", "--lr", "0.05", "--json"])
    rows = {r["name"]: r for r in out["approaches"]}
    assert set(rows) == {"1f1b", "xpipe", *(f"xpipe+{o}" for o in OPTIMIZER_ROWS)}
    spec = ModelSpec(kind="mlp", layers=8, hidden=8)
    setting = Setting(spec=spec, batch_size=4, steps=3, lr=ADAPTIVE_LR, optimizer="adabelief")
    losses = {}
    for name, schedule in (
        ("1f1b", generate("1f1b", num_stages=2, num_microbatches=2)),
        ("xpipe", generate("xpipe", num_stages=2, num_microbatches=2, num_steps=3)),
    ):
        result = run_reference(
            schedule, spec, steps=3, batch_size=4, seed=0, optimizer_factory=lambda ps: AdaBelief(ps, lr=ADAPTIVE_LR)
        )
        losses[name] = evaluate(setting, final_parameters(result.stage_parameters))
    row = rows["xpipe+adabelief"]
    assert row["convergence_eval_loss"] == [losses["xpipe"]]
    assert row["convergence_relative"] == [losses["xpipe"] / losses["1f1b"] - 1]
    assert row["convergence_eval_loss"] != rows["xpipe"]["convergence_eval_loss"]
    assert row["samples_per_s"] == rows["xpipe"]["samples_per_s"]  # the same schedule, simulated


def test_measured_columns_are_trains_record(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], costs: str
) -> None:
    records = iter(
        [
            {
                "step_time_s": 0.02,
                "samples_per_s": 800.0,
                "bubble_ratio": 0.3,
                "bubble_ratio_simulated": 0.2,
                "peak_activation_bytes": [10, 20],
                "weight_bytes": [5, 5],
            },
            {"error": "pipeweave train: error: something"},
            {
                "step_time_s": 0.04,
                "samples_per_s": 400.0,
                "bubble_ratio": 0.5,
                "bubble_ratio_simulated": 0.4,
                "peak_activation_bytes": [30, 20],
                "weight_bytes": [5, 7],
            },
            {"error": "pipeweave train: error: again"},
        ]
    )
    seen: list[list[str]] = []
    monkeypatch.setattr(
        compare_measure,
        "train_record",
        lambda name, args: seen.append(compare_measure.train_argv(name, args, Path("x"))) or next(records),
    )
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1}, raising=False)
    out = run_json(
        capsys,
        [
            "compare",
            "-s",
            "gpipe,1f1b",
            "-D",
            "2",
            "-T",
            "4",
            *MODEL,
            "--costs",
            costs,
            "--measure",
            "3",
            "--rounds",
            "2",
            "--json",
        ],
    )
    rows = {r["name"]: r for r in out["approaches"]}
    assert [argv[2] for argv in seen] == ["gpipe", "1f1b", "gpipe", "1f1b"]  # alternating rounds
    assert seen[0][seen[0].index("--steps") + 1] == "3" and "--hidden" in seen[0]
    gpipe = rows["gpipe"]  # the median of its two rounds, per rank for lists
    assert gpipe["measured_step_time_s"] == 0.03 and gpipe["measured_peak_activation_bytes"] == [20, 20]
    assert gpipe["measured_weight_bytes"] == [5, 6] and gpipe["measured_bubble_ratio_simulated"] == pytest.approx(0.3)
    assert rows["1f1b"]["measured_error"] == "pipeweave train: error: something"


@pytest.mark.slow
def test_measured_bytes_equal_a_train_run(capsys: pytest.CaptureFixture[str], costs: str, tmp_path: Path) -> None:
    out = run_json(
        capsys,
        [
            "compare",
            "-s",
            "1f1b",
            "-D",
            "2",
            "-T",
            "2",
            "--batch",
            "4",
            *MODEL,
            "--costs",
            costs,
            "--measure",
            "2",
            "--json",
        ],
    )
    row = out["approaches"][0]
    assert (
        main(
            [
                "train",
                "-s",
                "1f1b",
                "--stages",
                "2",
                "--microbatches",
                "2",
                "--batch",
                "4",
                "--steps",
                "2",
                *MODEL,
                "--quiet",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "train.json").read_text())
    assert row["measured_peak_activation_bytes"] == record["peak_activation_bytes"]
    assert row["measured_weight_bytes"] == record["weight_bytes"]


def test_class_rule_on_fixed_numbers() -> None:
    assert [classify(r) for r in (-0.1311, 0.0, 0.01, 0.0107, 0.05, 0.0501, math.inf, math.nan)] == [
        "excellent",
        "excellent",
        "excellent",
        "good",
        "good",
        "poor",
        "poor",
        "poor",
    ]
    # the seeds of pipedream-2bw and avgpipe in benchmarks/convergence/README.md
    twobw = seed_summary([-0.0268, 0.0880, -0.0235])
    assert twobw["classes"] == ["excellent", "poor", "excellent"] and twobw["class"] == "good (unstable)"
    assert seed_summary([0.0577, 0.0524, 0.0272])["class"] == "good (unstable)"
    assert seed_summary([0.0793, 0.0761, 0.0519]) == {
        "relative": [0.0793, 0.0761, 0.0519],
        "mean": pytest.approx(0.0691),
        "spread": pytest.approx(0.0274),
        "classes": ["poor"] * 3,
        "unstable": False,
        "class": "poor",
    }


def test_pareto_recommend_and_limits() -> None:
    assert pareto([(4, 0.3), (1, 0.3), (8, 0.0), (8, 0.1)]) == [1, 2]
    assert memory_bytes("2MiB") == 2.0 * 2**20 and memory_bytes("2e9") == 2e9
    rows = [
        {"name": "gpipe", "peak_activations": [8, 8], "samples_per_s": 100.0},
        {"name": "1f1b", "peak_activations": [2, 1], "samples_per_s": 90.0, "measured_samples_per_s": 80.0},
        {"name": "zb-h2", "peak_activations": [3, 2], "samples_per_s": 120.0},
    ]
    ranked, excluded = recommend(rows, (3.0, "M_a"))
    assert [r["name"] for r in ranked] == ["zb-h2", "1f1b"]  # 1f1b by its measured rate
    assert excluded == [{"name": "gpipe", "reason": "needs 8 M_a of activations on its fullest rank, over the limit"}]


def test_bad_input_is_one_line(cli_error: Any, costs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["compare", "-D", "2", "-T", "4", *MODEL, "--costs", costs]
    assert "unknown approach 'gpipe2'" in cli_error([*base, "-s", "gpipe,gpipe2"])
    assert "--activation-limit (0.5 M_a per rank) fits none of the approaches; the least any needs is 2 M_a" in (
        cli_error([*base, "-s", "gpipe,1f1b", "--recommend", "--activation-limit", "0.25"])
    )
    assert "--memory-limit 'lots' is invalid" in cli_error([*base, "--recommend", "--memory-limit", "lots"])
    assert "--memory-limit 4 is bytes per rank now; the activation multiple K is --activation-limit 4" in cli_error(
        [*base, "-s", "gpipe", "--recommend", "--memory-limit", "4"]
    )
    assert "both limit --recommend; give one of them" in cli_error(
        [*base, "--recommend", "--memory-limit", "1GiB", "--activation-limit", "1"]
    )
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1}, raising=False)
    err = cli_error(
        ["compare", "-D", "4", *MODEL, "--costs", costs, "--measure", "2"],
        "pipeweave.commands.compare_measure.train_record",
    )
    assert "--measure runs 4 ranks but this machine has 2 cores; give --stages 2 or fewer" in err
    for flag, value, mode in [
        ("--lr", "0.1", "--convergence"),
        ("--momentum", "0.5", "--convergence"),
        ("--seeds", "3", "--convergence"),
        ("--rounds", "2", "--measure"),
        ("--memory-limit", "1GiB", "--recommend"),
        ("--activation-limit", "1.5", "--recommend"),
    ]:  # ignored before: an option of a mode not asked for
        assert f"{flag} {value} applies to {mode} only; give {mode} too, or drop {flag}" in cli_error(
            [*base, "-s", "gpipe", flag, value]
        )


def test_default_set_skips_what_cannot_serve_the_setting(
    capsys: pytest.CaptureFixture[str], costs: str, cli_error: Any
) -> None:
    out = run_json(capsys, ["compare", "-D", "3", "-T", "4", *MODEL, "--costs", costs, "--json"])
    skipped = {e["name"]: e["reason"] for e in out["skipped"]}
    assert "even number of stages" in skipped["chimera"] and "1f1b" in [r["name"] for r in out["approaches"]]
    assert "even number of stages" in cli_error(
        ["compare", "-D", "3", "-T", "4", *MODEL, "--costs", costs, "-s", "1f1b,chimera"]
    )


@pytest.mark.slow
def test_convergence_reproduces_the_study(capsys: pytest.CaptureFixture[str]) -> None:
    """The convergence study's gpt setting gives its recorded results to the last bit (benchmarks/convergence)."""
    study = json.loads((Path(__file__).parents[2] / "benchmarks/convergence/results_gpt.json").read_text())
    recorded = {r["schedule"]: r["eval_loss"] for r in study["runs"]}
    out = run_json(
        capsys,
        [
            "compare",
            "-s",
            "1f1b,pipedream",
            "--model",
            "gpt",
            "--layers",
            "6",
            "--hidden",
            "32",
            "--heads",
            "2",
            "--seq-len",
            "32",
            "--convergence",
            "100",
            "--json",
        ],
    )
    assert {r["name"]: r["convergence_eval_loss"][0] for r in out["approaches"]} == {
        "1f1b": recorded["1f1b"],
        "pipedream": recorded["pipedream"],
    }
