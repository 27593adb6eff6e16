"""``pipeweave train --log-dir``: TensorBoard event files read back equal the run's JSON record, step by step."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest

from pipeweave.cli import main
from pipeweave.runtime.run.step_log import EventFile
from pipeweave.side_output import SideOutput

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _trace_bubbles(path: Path, steps: int) -> list[float]:
    """Per step, 1 - busy / (ranks x max span) of the Chrome trace's compute actions (DESIGN.md's bubble_ratio)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "compute"]
    out = []
    for k in range(steps):
        ranks = {}
        for e in (e for e in events if e["args"]["step"] == k):
            ranks.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
        busy = sum(b - a for row in ranks.values() for a, b in row)
        widest = max(max(b for _, b in row) - min(a for a, _ in row) for row in ranks.values())
        out.append(1 - busy / (len(ranks) * widest))
    return out


def test_logged_scalars_are_the_json_records(tmp_path: Path) -> None:
    steps = 4
    code = main(
        [
            "train",
            "-s",
            "zb-h1",
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
            "6",
            "--microbatches",
            "3",
            "--steps",
            str(steps),
            "--lr-schedule",
            "cosine",
            "--lr-warmup",
            "1",
            "--log-dir",
            str(tmp_path / "tb"),
            "--json",
            str(tmp_path / "train.json"),
            "--out",
            str(tmp_path / "out"),
            "--quiet",
        ]
    )
    assert code == 0
    record = json.loads((tmp_path / "train.json").read_text())
    folder = Path(record["log_dir"])
    assert folder.parent == tmp_path / "tb"  # the run's own folder there
    logged = _scalars(folder)
    f32 = lambda values: [float(np.float32(v)) for v in values]  # noqa: E731 - event files hold float32
    assert logged["train/loss"] == list(enumerate(f32(record["losses"])))
    assert logged["train/lr"] == list(enumerate(f32(record["lrs"])))
    assert len(set(record["lrs"])) > 1  # warm-up and decay: the rates move
    times = [v for _, v in logged["train/step_time_s"]]
    assert times == pytest.approx(record["step_times_s"], rel=1e-6)
    assert [v for _, v in logged["train/samples_per_s"]] == pytest.approx([6 / t for t in times], rel=1e-6)
    assert [v for _, v in logged["train/tokens_per_s"]] == pytest.approx([6 * 8 / t for t in times], rel=1e-6)
    bubbles = [v for _, v in logged["train/bubble_ratio"]]
    assert statistics.median(bubbles[1:]) == pytest.approx(record["bubble_ratio"], rel=1e-6)  # the record's median
    assert bubbles == pytest.approx(_trace_bubbles(tmp_path / "out" / "trace.json", steps), rel=1e-4)
    for r in (0, 1):
        assert len(logged[f"memory/rank{r}_bytes"]) == steps and all(v > 0 for _, v in logged[f"memory/rank{r}_bytes"])
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1  # one process writes


def test_an_event_file_whose_folder_is_removed_fails_its_next_write_once(tmp_path: Path) -> None:
    """A removed ``--log-dir`` took the events without a word: the file was gone, its writes went nowhere."""
    said: list[str] = []
    log = SideOutput(tmp_path / "tb", said.append)
    events = log.attempt(lambda: EventFile(tmp_path / "tb" / "run"))
    assert events is not None
    log.path = events.path  # as StepLog names it
    assert log.attempt(lambda: events.add_scalars({"train/loss": 1.0}, 0)) is None
    assert said == [] and _scalars(tmp_path / "tb" / "run")["train/loss"] == [(0, 1.0)]
    shutil.rmtree(tmp_path / "tb")
    for step in (1, 2):
        log.attempt(lambda: events.add_scalars({"train/loss": 1.0}, step))  # noqa: B023 - called at once
    assert said == [f"cannot write {events.path}: removed while the run wrote it"]
    events.abandon()


def test_log_dir_is_refused_in_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert main(["train", "--model", "mlp", "--log-dir", str(tmp_path / "file" / "tb")]) == 2
    err = capsys.readouterr().err
    assert "file is a file, not a folder" in err and len(err.splitlines()) == 1, err


def test_an_asynchronous_stream_logs_its_mini_batches_losses(tmp_path: Path) -> None:
    code = main(
        [
            "train",
            "-s",
            "pipedream",
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
            "6",
            "--microbatches",
            "3",
            "--steps",
            "6",
            "--eval-every",
            "3",
            "--log-dir",
            str(tmp_path / "tb"),
            "--json",
            str(tmp_path / "train.json"),
            "--out",
            str(tmp_path / "out"),
            "--quiet",
        ]
    )
    assert code == 0
    record = json.loads((tmp_path / "train.json").read_text())
    logged = _scalars(Path(record["log_dir"]))
    assert logged["train/loss"] == [(k, float(np.float32(v))) for k, v in enumerate(record["losses"])]
    assert "train/lr" not in logged and len(logged["train/step_time_s"]) == 6


def test_runs_sharing_a_log_dir_each_log_in_their_own_folder_a_resumed_run_in_its_runs(tmp_path: Path) -> None:
    """Two runs given one ``--log-dir`` wrote into it side by side: TensorBoard showed one run, their steps merged."""
    tb, ck = tmp_path / "tb", tmp_path / "ck"
    mlp = ["train", "--model", "mlp", "--layers", "4", "--hidden", "8", "--batch", "8", "--microbatches", "2"]
    records = []
    for k, more in enumerate((["--save", str(ck)], ["--resume", str(ck)], [])):
        record = tmp_path / f"{k}.json"
        argv = [*mlp, "--steps", "2", "--log-dir", str(tb), "--json", str(record), "--out", str(tmp_path), "--quiet"]
        assert main([*argv, *more]) == 0
        records.append(json.loads(record.read_text()))
    first, resumed, other = (Path(r["log_dir"]) for r in records)
    assert first == resumed != other and first.parent == other.parent == tb
    losses = records[0]["losses"] + records[1]["losses"]
    assert _scalars(first)["train/loss"] == [(k, float(np.float32(v))) for k, v in enumerate(losses)]
    assert [k for k, _ in _scalars(other)["train/loss"]] == [0, 1]
