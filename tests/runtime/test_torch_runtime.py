"""pipeweave's exported schedules train on torch.distributed.pipelining's own runtime as plain training does.

``pipeweave simulate --csv`` writes every synchronous schedule torch can run (naive, gpipe, 1f1b, zb-h1, zb-h2,
interleaved-1f1b, zb-v, dualpipe-v, and zb-auto and zb-v-auto as ``pipeweave search`` finds them; one and two
stages per rank); ``torch_runtime_job.py`` loads each into
torch's ``_PipelineScheduleRuntime`` on gloo and trains it; every microbatch's loss and every final weight
must equal plain (unpipelined) training's, rtol 1e-5. Two ranks run by default, four under ``-m slow``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeweave.cli import main
from pipeweave.schedule import read_csv

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

JOB = Path(__file__).with_name("torch_runtime_job.py")
STEPS = 2
# (name, simulate's flags, --csv-format): the compute_only form, and three compute_comms ones, the last with
# --zero 3's UNSHARD/RESHARD, run on blocks sharded by FSDP2 beside the compute_only file that torch lowers itself
SCHEDULES = [
    ("naive", ["-s", "naive"], "compute_only"),
    ("gpipe", ["-s", "gpipe"], "compute_only"),
    ("1f1b", ["-s", "1f1b"], "compute_only"),
    ("zb-h1", ["-s", "zb-h1"], "compute_only"),
    ("zb-h2", ["-s", "zb-h2"], "compute_only"),
    ("interleaved-1f1b", ["-s", "interleaved-1f1b", "--chunks", "2"], "compute_only"),
    ("zb-v", ["-s", "zb-v"], "compute_only"),
    ("dualpipe-v", ["-s", "dualpipe-v"], "compute_only"),
    ("interleaved-1f1b-comms", ["-s", "interleaved-1f1b", "--chunks", "2"], "compute_comms"),
    ("zb-v-comms", ["-s", "zb-v"], "compute_comms"),
    ("zb-v-fsdp", ["-s", "zb-v", "--zero", "3", "--data-parallel", "2"], "compute_comms"),
    ("zb-v-fsdp-torch", ["-s", "zb-v"], "compute_only"),
]


def _job_module():  # type: ignore[no-untyped-def]
    """The job script as a module: its model, data and learning rate, for the reference."""
    spec = importlib.util.spec_from_file_location("torch_runtime_job", JOB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain(num_stages: int, num_microbatches: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Unpipelined training of the job's model: per step the losses of its microbatches, then the weights."""
    job = _job_module()
    model = job.model(num_stages)
    optimizer = torch.optim.SGD(model.parameters(), lr=job.LR)
    losses = []
    for x, y in job.batches(STEPS):
        optimizer.zero_grad()
        per_mb = [
            torch.nn.functional.mse_loss(model(a), b)
            for a, b in zip(x.chunk(num_microbatches), y.chunk(num_microbatches))
        ]
        torch.stack(per_mb).mean().backward()
        optimizer.step()
        losses.append([float(v.detach()) for v in per_mb])
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _exported(tmp_path: Path, num_ranks: int, num_microbatches: int) -> list[dict[str, object]]:
    sizes = ["--stages", str(num_ranks), "--microbatches", str(num_microbatches)]
    found, found_v = tmp_path / "found.csv", tmp_path / "found-v.csv"  # pipeweave's own form, as search writes it
    assert main(["search", *sizes, "--solver", "heuristic", "--csv", str(found)]) == 0
    assert main(["search", *sizes, "--v-shape", "--solver", "heuristic", "--csv", str(found_v)]) == 0
    jobs = []
    searched = [
        ("zb-auto", ["--from-csv", str(found)], "compute_only"),
        ("zb-v-auto", ["--from-csv", str(found_v)], "compute_only"),
    ]
    for name, flags, fmt in [*SCHEDULES, *searched]:
        path = tmp_path / f"{name}.csv"
        assert (
            main(
                [
                    "simulate",
                    *(flags if flags[0] == "--from-csv" else [*flags, *sizes]),
                    "--csv",
                    str(path),
                    "--csv-format",
                    fmt,
                    "--json",
                ]
            )
            == 0
        )
        schedule = read_csv(path)
        assert schedule.num_microbatches == num_microbatches
        stage_rank = list(schedule.placement.stage_rank)
        jobs.append(
            {
                "name": name,
                "csv": str(path),
                "format": fmt,
                "microbatches": num_microbatches,
                "stage_rank": stage_rank,
                "fsdp": "-fsdp" in name,  # the blocks under FSDP2: UNSHARD/RESHARD run
            }
        )
    return jobs


def _trained(out: Path, job: dict[str, Any], num_ranks: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """A job's losses (from the rank holding the last stage) and every stage's final weights."""
    losses: list[list[float]] = []
    weights: dict[str, torch.Tensor] = {}
    for rank in range(num_ranks):
        record = torch.load(out / f"{job['name']}-rank{rank}.pt")
        losses = record["losses"] or losses
        weights.update(record["weights"])
    return losses, weights


def _check(tmp_path: Path, num_ranks: int, num_microbatches: int, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = _exported(tmp_path, num_ranks, num_microbatches)
    capsys.readouterr()
    out = tmp_path / "out"
    out.mkdir()
    spec = {"world": num_ranks, "steps": STEPS, "jobs": jobs, "out": str(out), "store": str(tmp_path / "store")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(JOB), str(tmp_path / "spec.json")], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    by_name = {job["name"]: job for job in jobs}
    for job in jobs:
        if job["name"] == "zb-v-fsdp-torch":
            continue
        losses, weights = _trained(out, job, num_ranks)
        if job["fsdp"]:  # torch's own lowering of the same order under FSDP2 (which itself is off plain training)
            expected = _trained(out, by_name["zb-v-fsdp-torch"], num_ranks)
        else:
            expected = _plain(len(job["stage_rank"]), num_microbatches)
        torch.testing.assert_close(losses, expected[0], rtol=1e-5, atol=1e-7, msg=job["name"])
        assert weights.keys() == expected[1].keys(), job["name"]
        for key, value in weights.items():
            torch.testing.assert_close(value, expected[1][key], rtol=1e-5, atol=1e-7, msg=f"{job['name']} {key}")
    assert {j["name"] for j in jobs if len(j["stage_rank"]) == 2 * num_ranks} == {
        "interleaved-1f1b",
        "zb-v",
        "dualpipe-v",
        "interleaved-1f1b-comms",
        "zb-v-comms",
        "zb-v-fsdp",
        "zb-v-fsdp-torch",
        "zb-v-auto",
    }


def test_exported_schedules_train_on_torch_runtime_two_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _check(tmp_path, 2, 4, capsys)


@pytest.mark.slow
def test_exported_schedules_train_on_torch_runtime_four_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _check(tmp_path, 4, 8, capsys)
