"""``pipeweave train`` under torchrun: two invocations on loopback acting as two nodes.

Each torchrun is one "node" (``--nnodes 2 --node-rank 0/1 --nproc-per-node 1``)
meeting at 127.0.0.1; ``pipeweave train`` sees RANK/WORLD_SIZE/MASTER_ADDR,
joins that group instead of spawning, and rank 0 writes the JSON record. The
losses must equal plain training's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeweave.models import ModelSpec
from pipeweave.runtime.plain import run_plain

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(
    tmp_path: Path, train: list[str], nproc: int = 1, codes: tuple[int, int] = (0, 0), env: dict[str, str] | None = None
) -> list[str]:
    """Run ``train`` under two torchrun "nodes" on loopback; return their logs' tails, assert their exit codes.

    Logs go to files, not pipes: a pipe nobody drains while we wait on the other
    node fills up and blocks that node, which the waited-on node then waits for.
    """
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun is installed with torch"
    port = _free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    nodes = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                str(nproc),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *train,
            ],
            stdout=logs[n].open("w"),
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env={**os.environ, **(env or {})},
        )
        for n in (0, 1)
    ]
    try:
        for node in nodes:
            node.wait(timeout=150)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    outputs = [log.read_text(errors="replace")[-3000:] for log in logs]
    assert tuple(n.returncode for n in nodes) == codes, outputs
    return outputs


def test_two_torchrun_nodes_on_loopback_train_exactly(tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "3",
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        "8",
        "--batch",
        "7",
        "--steps",
        "3",
        "--quiet",
        "--out",
        str(tmp_path),
        "--json",
        str(record),
    ]
    _two_nodes(tmp_path, train)
    report = json.loads(record.read_text())
    plain = run_plain(ModelSpec(kind="mlp", layers=4, hidden=8), steps=3, batch_size=7, num_microbatches=3)
    assert report["losses"] == pytest.approx(plain.losses, rel=1e-5)
    assert report["stages"] == 2 and len(report["weight_bytes"]) == 2


def test_an_asynchronous_stream_across_two_torchrun_nodes_equals_the_reference(tmp_path: Path) -> None:
    """PipeDream's stream (weight stashing) under torchrun: gloo between the nodes, losses = the reference's."""
    import torch

    from pipeweave.runtime.reference import run_reference
    from pipeweave.schedule import generate

    record = tmp_path / "record.json"
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "pipedream",
        "--stages",
        "2",
        "--microbatches",
        "3",
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        "8",
        "--batch",
        "7",
        "--steps",
        "4",
        "--lr",
        "0.05",
        "--momentum",
        "0.9",
        "--quiet",
        "--out",
        str(tmp_path),
        "--json",
        str(record),
    ]
    _two_nodes(tmp_path, train)
    report = json.loads(record.read_text())
    schedule = generate("pipedream", num_stages=2, num_microbatches=3, num_steps=4)
    reference = run_reference(
        schedule,
        ModelSpec(kind="mlp", layers=4, hidden=8),
        steps=4,
        batch_size=7,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    )
    assert report["transport"] == "gloo"
    assert report["losses"] == pytest.approx(reference.losses, rel=1e-5)
    assert report["weight_bytes"] == report["weight_bytes_simulated"]


def _workers_of(marker: str) -> list[int]:
    """PIDs of live processes whose command line holds ``marker``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_torchrun_node_ends_the_other_without_leftovers(tmp_path: Path) -> None:
    import signal
    import time

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None
    port = _free_port()
    out = tmp_path / "run"
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "3",
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        "8",
        "--batch",
        "7",
        "--steps",
        "1000000",
        "--timeout",
        "20",
        "--out",
        str(out),
    ]
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    nodes = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *train,
            ],
            stdout=logs[n].open("w"),
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        for n in (0, 1)
    ]
    try:
        # Training has started once both ranks have burnt more CPU than importing torch
        # and joining the group take (the progress bar only renders at the end off a terminal).
        deadline = time.monotonic() + 150
        while sum(_cpu_seconds(p) > 6.0 for p in _workers_of(str(out))) < 2:
            assert time.monotonic() < deadline and nodes[0].poll() is None, logs[0].read_text()
            time.sleep(0.5)
        nodes[1].send_signal(signal.SIGKILL)  # the agent dies without a chance to stop its worker
        t0 = time.monotonic()
        nodes[0].wait(timeout=60)
        assert time.monotonic() - t0 < 30
        assert nodes[0].returncode != 0
        time.sleep(1)
        assert _workers_of(str(out)) == []  # no rank of either node left behind
        assert logs[0].read_text().count("pipeweave: rank 0 failed") == 1
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        for pid in _workers_of(str(out)):
            os.kill(pid, signal.SIGKILL)


def test_data_parallel_pipelines_across_two_torchrun_nodes(tmp_path: Path) -> None:
    """P = 2 replicas of a D = 2 pipeline on 2 nodes x 2 processes equal plain training on the global batch."""
    record = tmp_path / "record.json"
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "1f1b",
        "--stages",
        "2",
        "--data-parallel",
        "2",
        "--microbatches",
        "3",
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        "8",
        "--batch",
        "14",
        "--steps",
        "3",
        "--quiet",
        "--out",
        str(tmp_path),
        "--json",
        str(record),
    ]
    _two_nodes(tmp_path, train, nproc=2)
    report = json.loads(record.read_text())
    # The global batch of 14 samples is split into P x T = 6 microbatches.
    plain = run_plain(ModelSpec(kind="mlp", layers=4, hidden=8), steps=3, batch_size=14, num_microbatches=6)
    assert report["losses"] == pytest.approx(plain.losses, rel=1e-5)
    assert len(report["weight_bytes"]) == 4


def test_tensor_parallel_inside_each_of_two_torchrun_nodes(tmp_path: Path) -> None:
    """TP = 2 inside each node (its 2 processes split every layer), the pipeline's 2 stages across the nodes."""
    record = tmp_path / "record.json"
    spec = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8)
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "zb-h1",
        "--stages",
        "2",
        "--tensor-parallel",
        "2",
        "--microbatches",
        "3",
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
        "--steps",
        "3",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--quiet",
        "--out",
        str(tmp_path),
        "--json",
        str(record),
    ]
    _two_nodes(tmp_path, train, nproc=2)
    report = json.loads(record.read_text())
    plain = run_plain(spec, steps=3, batch_size=6, num_microbatches=3)
    assert report["losses"] == pytest.approx(plain.losses, rel=1e-5)
    assert len(report["weight_bytes"]) == 2  # one record per stage rank


def test_two_torchrun_nodes_train_a_model_file_exactly(tmp_path: Path) -> None:
    """Your own model under torchrun: each node loads the file itself (``models.custom``)."""
    entry = f"{Path(__file__).resolve().parent.parent / 'models' / 'tiny_custom.py'}:model"
    record = tmp_path / "record.json"
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "zb-h1",
        "--stages",
        "2",
        "--microbatches",
        "3",
        "--model",
        entry,
        "--batch",
        "7",
        "--steps",
        "3",
        "--optimizer",
        "sgd",
        "--quiet",
        "--out",
        str(tmp_path),
        "--json",
        str(record),
    ]
    _two_nodes(tmp_path, train)
    report = json.loads(record.read_text())
    plain = run_plain(ModelSpec(kind="custom", entry=entry), steps=3, batch_size=7, num_microbatches=3)
    assert report["losses"] == pytest.approx(plain.losses, rel=1e-5)


def test_a_killed_rank_restarted_by_torchrun_resumes_its_newest_checkpoint(
    tmp_path: Path, checkpoint_tensors: Callable[[Path], dict[str, Any]]
) -> None:
    """`torchrun --max-restarts 1 ... --save DIR --resume auto`: rank 1 is SIGKILLed once in step 5; torchrun
    restarts both ranks, which resume the checkpoint of step 4 (the dead run's lock is stale) and end the
    training as an uninterrupted run would: the same losses and final weights as plain training."""
    import torch

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None
    entry = f"{Path(__file__).resolve().parent.parent / 'models' / 'dies_once.py'}:model"
    record, ck, marker = tmp_path / "record.json", tmp_path / "ck", tmp_path / "killed"
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--model",
        entry,
        "--batch",
        "8",
        "--steps",
        "8",
        "--optimizer",
        "sgd",
        "--save",
        str(ck),
        "--save-every",
        "2",
        "--resume",
        "auto",
        "--quiet",
        "--out",
        str(tmp_path),
        "--json",
        str(record),
    ]
    log = tmp_path / "torchrun.log"
    # The rendezvous store shared with the ranks may hand a restarted gloo rank its dead peer's address
    # (pytorch/pytorch#135712); a store of the ranks' own per attempt does not.
    env = {**os.environ, "PIPEWEAVE_TEST_DIE_ONCE": str(marker), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    done = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.5",
            *train,
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env=env,
        timeout=150,
    )
    assert done.returncode == 0, log.read_text()[-3000:]
    assert marker.exists()  # rank 1 did die once
    report = json.loads(record.read_text())
    plain = run_plain(ModelSpec(kind="custom", entry=entry), steps=8, batch_size=8, num_microbatches=2)
    assert report["first_step"] == 4 and report["steps"] == 4  # the restart resumed step 4's checkpoint
    assert report["losses"] == pytest.approx(plain.losses[4:], rel=1e-5)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000006", "step-000008"]
    saved = {
        key.removeprefix("parameters/"): value
        for key, value in checkpoint_tensors(ck / "step-000008").items()
        if key.startswith("parameters/")
    }
    assert set(saved) == set(plain.parameters)
    for name, value in plain.parameters.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6)


SPLIT_BY_RANK = Path(__file__).resolve().with_name("split_by_rank.py")


@pytest.mark.slow
def test_torchrun_ranks_that_profile_apart_train_rank_0s_partition(tmp_path: Path) -> None:
    """``--partition time`` where each rank measures its own costs (a cache of its own, another block costly:
    alone, rank 0 would cut 2 + 4 layers, rank 1 4 + 2): every rank takes rank 0's layer counts
    (``agreement.agreed_plan``), and the run equals plain training."""
    record = tmp_path / "record.json"
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--model",
        f"{SPLIT_BY_RANK}:net",
        "--partition",
        "time",
        "--batch",
        "4",
        "--steps",
        "2",
        "--optimizer",
        "sgd",
        "--timeout",
        "60",
        "--quiet",
        "--out",
        str(tmp_path),
        "--json",
        str(record),
    ]
    _two_nodes(tmp_path, train, env={"PIPEWEAVE_CACHE": str(tmp_path / "cache")})
    report = json.loads(record.read_text())
    embed, block, head = (32 * 16) * 4, (16 * 16 + 16) * 4, (16 * 32 + 32) * 4  # parameter bytes
    assert report["weight_bytes"] == [embed + block, 3 * block + head]  # rank 0's 2 + 4 layers
    plain = run_plain(ModelSpec(kind="custom", entry=f"{SPLIT_BY_RANK}:net"), steps=2, batch_size=4, num_microbatches=2)
    assert report["losses"] == pytest.approx(plain.losses, rel=1e-5)


@pytest.mark.slow
def test_torchrun_ranks_whose_model_cut_itself_apart_stop_in_one_line(tmp_path: Path) -> None:
    """A model file cut by ``pipeweave.pipeline(net, split_points=2)`` in each rank, each measuring apart: every
    rank stops before building a stage, with one line naming both splits (``agreement.check_split``)."""
    train = [
        "-m",
        "pipeweave.cli",
        "train",
        "-s",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--model",
        f"{SPLIT_BY_RANK}:profiled",
        "--batch",
        "4",
        "--steps",
        "2",
        "--optimizer",
        "sgd",
        "--timeout",
        "60",
        "--quiet",
        "--out",
        str(tmp_path),
    ]
    outputs = _two_nodes(tmp_path, train, codes=(1, 1), env={"PIPEWEAVE_CACHE": str(tmp_path / "cache")})
    line = "pipeweave: ranks chose different splits of the model (rank 1: cut at ['4'], layers 0-0 | 1-1, "
    assert line in outputs[0] and "rank 0: cut at ['2'], layers 0-0 | 1-1" in outputs[0], outputs
    assert "pipeweave:" not in outputs[1], outputs  # one line, from rank 0


@pytest.mark.slow
def test_a_torchrun_script_that_forms_the_group_first_profiles_on_rank_0_alone(tmp_path: Path) -> None:
    """``split_by_rank.py`` run as a script: ``pipeline(net, split_points=2)`` after ``init_process_group``
    takes rank 0's cuts on both ranks (rank 1 measured nothing), and ``launch`` joins that group."""
    _two_nodes(tmp_path, [str(SPLIT_BY_RANK)], env={"PIPEWEAVE_CACHE": str(tmp_path / "cache")})
    # the whole logs: under load, what the ranks print after the line (gloo teardown) can push it out of the tails
    logs = [(tmp_path / f"node{n}.log").read_text(errors="replace") for n in (0, 1)]
    said = [json.loads(next(line for line in out.splitlines() if line.startswith('{"cut at"'))) for out in logs]
    assert [s["cut at"] for s in said] == [["2"], ["2"]]  # rank 1 alone cuts before child 4
    plain = run_plain(ModelSpec(kind="custom", entry=f"{SPLIT_BY_RANK}:net"), steps=2, batch_size=4, num_microbatches=2)
    assert said[0]["losses"] == pytest.approx(plain.losses, rel=1e-5)
    assert (tmp_path / "cache" / "rank0").exists() and not (tmp_path / "cache" / "rank1").exists()
