"""``pipeweave train``: the JSON record's fields, against plain training and closed forms."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from pipeweave.models import ModelSpec
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.prepare import prepare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

HIDDEN = 16
MODELS = Path(__file__).resolve().parents[1] / "models"


def _train(tmp_path: Path, *argv: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    record = tmp_path / "record.json"
    run = subprocess.run(
        [sys.executable, "-m", "pipeweave.cli", "train", *argv, "--out", str(tmp_path / "out"), "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(record.read_text()), run


def test_json_record_of_an_mlp_run(tmp_path: Path) -> None:
    report, run = _train(
        tmp_path,
        "-s",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        str(HIDDEN),
        "--batch",
        "8",
        "--steps",
        "4",
        "--quiet",
    )
    assert run.stdout == ""  # --quiet
    assert (report["schedule"], report["stages"], report["microbatches"], report["steps"]) == ("1f1b", 2, 4, 4)
    plain = run_plain(ModelSpec(kind="mlp", layers=4, hidden=HIDDEN), steps=4, batch_size=8, num_microbatches=4)
    assert report["losses"] == pytest.approx(plain.losses, rel=1e-5)
    assert report["step_time_s"] > 0
    assert report["samples_per_s"] == pytest.approx(8 / report["step_time_s"])
    for key in ("bubble_ratio", "bubble_ratio_flush", "bubble_ratio_simulated"):
        assert 0.0 <= report[key] < 1.0, key
    # The flush bubble counts the whole makespan, the bubble each rank's own span: never less, per step and so in
    # the median. (How much more depends on when the last rank starts: under load, up to 0.07 was measured.)
    assert report["bubble_ratio_flush"] >= report["bubble_ratio"]
    assert report["bubble_ratio_flush_simulated"] == pytest.approx(report["bubble_ratio_simulated"], abs=1e-9)
    # two blocks per rank: LayerNorm (2h) + Linear(h, 4h) + Linear(4h, h), float32
    block = 4 * (2 * HIDDEN + (HIDDEN * 4 * HIDDEN + 4 * HIDDEN) + (4 * HIDDEN * HIDDEN + HIDDEN))
    assert report["weight_bytes"] == [2 * block, 2 * block]
    assert len(report["peak_activation_bytes"]) == 2 and all(b > 0 for b in report["peak_activation_bytes"])
    # the Chrome trace holds every action of every step of both ranks
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    actions = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    per_step = 2 * (4 + 4 + 1) + 2 * 2 * 4  # F, B, U on 2 ranks + one send and one receive per message
    assert len(actions) == 4 * per_step


def test_default_model_is_the_gpt_with_a_summary(tmp_path: Path) -> None:
    report, run = _train(tmp_path, "--steps", "2")
    assert report["model"]["kind"] == "gpt" and report["stages"] == 2
    assert report["tokens_per_s"] == pytest.approx(report["samples_per_s"] * report["model"]["seq_len"])
    assert len(report["losses"]) == 2
    for needle in ("loss first -> last", "bubble ratio", "rank 1 memory", "json:", "trace:"):
        assert needle in run.stdout, needle
    # a synchronous run of an untied model cut by pipeweave's own layers: no staleness, no tie, no split names
    assert not {"staleness", "tied_lag", "split_points"} & report.keys()
    assert "staleness" not in run.stdout and "split:" not in run.stdout


def test_a_tied_module_split_on_pipedream_2bw_says_where_it_was_cut_and_its_tied_lag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A split ``nn.Sequential`` whose last layer reuses its first one's weight, on 2BW, in-process: the line
    naming the cuts uses the model's split points at the parts' starts, and the record and the summary show the
    stream's staleness and tied lag as the simulator gives them (``runtime.stage.tied_stream``)."""
    from pipeweave.cli import main
    from pipeweave.models.spec import uniform_parts
    from pipeweave.schedule import generate
    from pipeweave.sim.versions import staleness, tied_lag

    entry = f"{MODELS / 'tiny_modules.py'}:tied_sequential"
    assert (
        main(
            [
                "train",
                "-s",
                "pipedream-2bw",
                "--model",
                entry,
                "--stages",
                "2",
                "--microbatches",
                "2",
                "--batch",
                "4",
                "--steps",
                "2",
                "--out",
                str(tmp_path),
                "--json",
                str(tmp_path / "t.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    names = ModelSpec(kind="custom", entry=entry).custom.split_points  # a layer per child: 1, 2, 3, 4 start one
    cuts = [names[part.start - 1] for part in uniform_parts(len(names) + 1, 2)[1:]]
    assert cuts == ["3"] and out.count("split: ") == 1
    assert "split: layers 0-2 | 3-4, cut before 3\n" in out
    report = json.loads((tmp_path / "t.json").read_text())
    stream = generate("pipedream-2bw", num_stages=2, num_microbatches=2, num_steps=2)
    assert report["split_points"] == cuts
    assert report["tied_lag"] == list(tied_lag(stream)) == [0, 1]
    assert report["staleness"] == list(staleness(stream, tied=True))
    rows = {line.split("│")[1].strip(): line.split("│")[3].strip() for line in out.splitlines() if line.count("│") == 4}
    assert rows["staleness / stage"] == "1 1" and rows["tied lag / stage"] == "0 1"


@pytest.mark.slow  # a 3-process run
def test_pipedream_prints_noam_and_in_flight_sets_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """PipeDream's summary shows the microbatches stage 0 held in flight (NOAM, by default D:
    tests/schedule/test_asynchronous.py), measured from the ranks' records beside the schedule's;
    ``--in-flight N`` sets it."""
    from pipeweave.cli import main

    mlp = ["--model", "mlp", "--layers", "3", "--hidden", "8", "--batch", "4", "--steps", "2", "--microbatches", "2"]
    argv = ["train", "-s", "pipedream", "--stages", "3", "--in-flight", "2", *mlp, "--json", str(tmp_path / "t.json")]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["in_flight"] == report["in_flight_simulated"] == 2  # NOAM would be 3
    rows = {line.split("│")[1].strip(): line.split("│")[2:4] for line in capsys.readouterr().out.splitlines()
            if line.count("│") == 4}  # fmt: skip
    assert [v.strip() for v in rows["in flight at stage 0"]] == ["2", "2"] and "(NOAM ceil(3/1) = 3)" in rows
    assert report["noam"] == 3 and "stage_replicas" not in report


def _head_heavy_costs(path: Path) -> Path:
    """Six layers, the first two 4x as slow and light in parameters: PipeDream's planner gives them two
    ranks and the other four one (``partition.pipedream``: the heavy weights make replicating those costly)."""
    from pipeweave.partition.problem import LayerCosts

    n, heavy = 6, range(2)
    times = tuple(4.0 if i in heavy else 1.0 for i in range(n))
    costs = LayerCosts.uniform(n)
    params = tuple(1e9 if i in heavy else 5e10 for i in range(n))
    costs = dataclasses.replace(costs, forward=times, input_grad=times, weight_grad=times, params=params)
    costs.save(path)
    return path


@pytest.mark.slow  # a 3-process run
def test_partition_pipedream_trains_its_replicated_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--partition pipedream`` replicating part 0 on 3 processes: 1F1B-RR runs it, equal to the reference
    executor (tests/runtime/test_replicated_stages.py compares more), the summary saying NOAM and the replicas."""
    from pipeweave.cli import main
    from pipeweave.config import TrainConfig
    from pipeweave.config.toml import loads
    from pipeweave.runtime.reference import run_reference
    from pipeweave.runtime.run.prepare import build_schedule, layer_ranges, optimizer_factory
    from pipeweave.runtime.run.resolve import resolve

    costs = str(_head_heavy_costs(tmp_path / "costs.json"))
    mlp = ["--model", "mlp", "--layers", "6", "--hidden", "8", "--batch", "8", "--steps", "2", "--microbatches", "4"]
    argv = ["train", "-s", "pipedream", "--stages", "3", "--partition", "pipedream", "--costs", costs, *mlp]
    assert main([*argv, "--json", str(tmp_path / "t.json"), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["stage_replicas"] == [2, 1] and report["noam"] == 2 == report["in_flight"]
    out = capsys.readouterr().out
    assert "replicas 2,1 (1F1B-RR)" in out and "(NOAM ceil(3/2) = 2)" in out
    config = resolve(loads(report["config"], TrainConfig))  # the run's TOML reruns it: same plan, same replicas
    schedule = build_schedule(config)
    parts = layer_ranges(config, schedule)
    reference = run_reference(
        schedule, config.model, steps=2, batch_size=8, optimizer_factory=optimizer_factory(config), parts=parts
    )
    assert schedule.placement.stage_part == (0, 0, 1) and config.partition.layers_per_part == (2, 4)
    assert report["losses"] == pytest.approx(reference.losses, rel=1e-5)


@pytest.mark.slow  # 23 s; resuming on another schedule is in the default run in-process (runtime/test_checkpoint.py)
def test_save_then_resume_on_another_schedule_continues_the_gpt_run(tmp_path: Path) -> None:
    gpt = ["--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch", "4"]
    straight, _ = _train(tmp_path / "straight", *gpt, "--steps", "5", "--quiet")
    ckpt = str(tmp_path / "ckpt")
    first, run = _train(tmp_path / "first", *gpt, "--steps", "3", "--save", ckpt)
    # the newest checkpoint's own folder (rich wraps long paths: the lines joined)
    assert f"checkpoint: {ckpt}/step-000003" in run.stdout.replace("\n", "") and first["first_step"] == 0
    second, run = _train(tmp_path / "second", *gpt, "--steps", "2", "-s", "gpipe", "--stages", "3", "--resume", ckpt)
    assert "resumed after step 3: steps 4-5 of the training" in run.stdout
    assert second["first_step"] == 3
    assert first["losses"] + second["losses"] == pytest.approx(straight["losses"], rel=1e-5)


def test_held_out_loss_in_the_record_the_summary_and_the_progress_bar(tmp_path: Path) -> None:
    gpt = ["--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch", "4"]
    report, run = _train(tmp_path, *gpt, "--steps", "5", "--eval-every", "2", "--eval-batches", "3")
    assert [e["step"] for e in report["eval_losses"]] == [2, 4, 5]
    assert all(e["loss"] > 0 for e in report["eval_losses"])
    last = report["eval_losses"][-1]["loss"]
    assert "held-out loss (step 2 -> 5)" in run.stdout and f"held-out {last:.4f}" in run.stdout
    # that evaluating trains nothing (the losses are plain training's): runtime/test_evaluation.py, in-process


@pytest.mark.slow  # 24 s; a stream cut by evaluations and resumed is in the default run (runtime/test_stream_segments.py)
def test_an_asynchronous_run_evaluates_saves_and_resumes_between_its_streams(tmp_path: Path) -> None:
    gpt = [
        "-s",
        "pipemare",
        "--warmup-steps",
        "1",
        "--model",
        "gpt",
        "--layers",
        "2",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--seq-len",
        "8",
        "--batch",
        "4",
        "--lr-schedule",
        "cosine",
        "--lr-decay-steps",
        "6",
    ]
    ckpt = str(tmp_path / "ckpt")
    straight, run = _train(
        tmp_path / "straight", *gpt, "--steps", "6", "--eval-every", "2", "--save", ckpt, "--save-every", "4"
    )
    assert straight["streams"] == 3 and straight["paused_s"] > 0  # drained after steps 2 and 4
    assert [e["step"] for e in straight["eval_losses"]] == [2, 4, 6]
    assert "3 streams, drained between them to evaluate or save" in run.stdout
    assert len(straight["lrs"]) == 6  # pipemare: one update per mini-batch, each its step's rate
    first, _ = _train(
        tmp_path / "first", *gpt, "--steps", "4", "--eval-every", "2", "--save", str(tmp_path / "c4"), "--quiet"
    )
    # resumed and saved into the same folder: the record still counts from what the folder held at the start
    second, run = _train(
        tmp_path / "second",
        *gpt,
        "--steps",
        "2",
        "--resume",
        str(tmp_path / "c4"),
        "--save",
        str(tmp_path / "c4"),
        "--quiet",
    )
    assert second["first_step"] == 4 and second["streams"] == 1
    assert first["losses"] + second["losses"] == pytest.approx(straight["losses"], rel=1e-5)
    assert first["lrs"] + second["lrs"] == pytest.approx(straight["lrs"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--clip-grad-norm", "0"], "--clip-grad-norm 0.0 is invalid; give a norm > 0"),
        (["-s", "chimera", "--clip-grad-norm", "1"], "post-validation needs one stage per rank"),
        (
            ["-s", "1f1b", "--memory-limit", "2e9"],
            "--memory-limit 2e+09 (bytes per rank) applies to --partition memory",
        ),
        (
            ["-s", "zb-auto", "--memory-limit", "2"],
            "--memory-limit 2 is bytes per rank now; the activation multiple K is --activation-limit 2",
        ),
        (["-s", "1f1b", "--activation-limit", "2"], "--activation-limit applies to zb-auto, zb-v-auto, not 1f1b"),
        (["-s", "zb-auto", "--activation-limit", "0"], "--activation-limit 0.0 is invalid; give K > 0"),
        (["--partition", "memory", "--memory-limit", "lots"], "--memory-limit 'lots' is invalid; give bytes per rank"),
        (["--resume", "no-such-folder"], "--resume no-such-folder: no checkpoint there"),
        (["--eval-every", "2"], "--eval-every applies to --model gpt"),
        (
            ["-s", "avgpipe", "--steps", "8", "--save", "ckpt", "--save-every", "3"],
            "--save-every 3 is not a multiple of avgpipe's P=2 pipelines (each stream between two drains is whole "
            "rounds); give --save-every 4",
        ),
        (
            ["--precision", "fp16", "-s", "pipedream"],
            "--precision fp16 skips the update of a step whose gradients overflow, and pipedream updates per "
            "microbatch with no step to skip; give --precision bf16 or a synchronous schedule",
        ),
        (["--precision", "fp16", "--loss-scale-backoff", "2"], "--loss-scale-backoff 2.0 is invalid; give a factor"),
        (["--precision", "bfloat16"], "--precision 'bfloat16' is unknown; give one of: fp32, bf16, fp16"),
        (
            ["--layers-per-stage", "1,2"],
            "--layers-per-stage 1,2 sums to 3 layers but the model has 4; make the counts sum to 4",
        ),
        (
            ["--model", "gpt", "--heads", "2", "--layers-per-stage", "2,2"],
            "--layers-per-stage 2,2 sums to 4 layers but the model has 6 (the embedding, 4 blocks, the head); make the "
            "counts sum to 6",
        ),
        (
            ["--model", "gpt", "--heads", "2", "--layers", "1", "--stages", "4"],
            "4 parts (zb-h1, D=4) need at least 4 layers, the model has 3 (the embedding, 1 block, the head)",
        ),
        (["-s", "avgpipe", "--own-ranks", "--avg-every", "0"], "--avg-every 0 is invalid; give N >= 1 rounds"),
    ],
)
def test_misplaced_options_are_one_line_before_spawning(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeweave.cli import main

    assert main(["train", "--model", "mlp", "--layers", "4", "--hidden", "8", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_config_file_with_k_as_memory_limit_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeweave.cli import main

    path = tmp_path / "zb.toml"
    schedule = '[schedule]\nname = "zb-auto"\nnum_stages = 2\nnum_microbatches = 4\n'
    path.write_text(f'[model]\nkind = "mlp"\nlayers = 4\nhidden = 8\n{schedule}[partition]\nmemory_limit = 1.5\n')
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--memory-limit 1.5 is bytes per rank now; the activation multiple K is --activation-limit 1.5")
    path.write_text(f'[model]\nkind = "mlp"\nlayers = 4\nhidden = 8\n{schedule}activation_limit = 1.5\n')
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    assert "activation_limit = 1.5" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("model", "text", "message"),
    [
        ("gpt", None, "cannot read --data"),
        ("gpt", "abc", "the corpus has 3 bytes, fewer than one window of seq_len+1=9"),
        ("mlp", "abc" * 100, "--data applies to --model gpt, llama or hf:"),
    ],
)
def test_a_bad_data_file_is_one_line_before_spawning(
    model: str, text: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeweave.cli import main

    path = tmp_path / "corpus.txt"
    if text is not None:
        path.write_text(text)
    with patch("pipeweave.runtime.run.launch._spawn", side_effect=AssertionError("spawned")):
        code = main(
            [
                "train",
                "--model",
                model,
                "--layers",
                "2",
                "--hidden",
                "16",
                "--heads",
                "2",
                "--seq-len",
                "8",
                "--data",
                str(path),
            ]
        )
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_zb_auto_is_searched_for_the_profiled_costs_and_its_activation_limit(tmp_path: Path) -> None:
    from pipeweave.cli import build_parser
    from pipeweave.commands.train_run import build_config
    from pipeweave.sim import CostModel, compute_metrics, simulate

    args = build_parser().parse_args(
        [
            "train",
            "-s",
            "zb-auto",
            "--stages",
            "2",
            "--microbatches",
            "4",
            "--model",
            "mlp",
            "--layers",
            "4",
            "--hidden",
            "16",
            "--activation-limit",
            "2",
        ]
    )
    config = build_config(args)
    options = dict(config.schedule_options)
    assert options["activation_limit"] == 2
    for key in ("time_f", "time_b", "time_w"):  # one profiled time per part, in seconds
        assert len(options[key]) == 2 and all(t > 0 for t in options[key])
    schedule = prepare(config).schedule
    cost = CostModel(f=options["time_f"], b=options["time_b"], w=options["time_w"])
    peaks = compute_metrics(simulate(schedule, cost)).peak_activations
    assert max(peaks) <= 2 * 2 + 1e-9  # K x D x M_a
    assert max(peaks) > 2  # the limit is used: deeper than 1F1B's D x M_a


@pytest.mark.parametrize("quiet", [True, False])
def test_the_progress_sink_keeps_nothing_per_step(quiet: bool) -> None:
    """The launcher's progress sink forgets a step once every rank's loss share is in: before, it kept a dict
    per step for the whole run, and a 35-minute soak of 12376 steps (benchmarks/soak) saw the launcher's
    resident memory grow by 0.3 MiB per 1000 steps."""
    from pipeweave.commands.train_run import _Progress
    from pipeweave.config import TrainConfig

    config = TrainConfig()
    with _Progress(config, world=2, quiet=quiet) as progress:
        for step in range(50):
            for rank in (1, 0):
                progress.update(rank, {"step": step, "loss": 0.5})
            if step % 10 == 9:
                for rank in (0, 1):
                    progress.update(rank, {"eval": step + 1, "loss": 0.25})
        progress.update(0, {"step": 50, "loss": 0.5})  # a step still waiting for rank 1's share
        assert progress.shares == {50: {0: 0.5}} and progress.eval_shares == {}
        assert progress.eval_text == "  held-out 0.5000"
        if not quiet:
            assert progress.loss_text == "loss 1.0000"
