"""``pipeweave train`` under torchrun: two invocations on loopback acting as two nodes.

Each torchrun is one "node" (``--nnodes 2 --node-rank 0/1 --nproc-per-node 1``)
meeting at 127.0.0.1; ``pipeweave train`` sees RANK/WORLD_SIZE/MASTER_ADDR,
joins that group instead of spawning, and rank 0 writes the JSON record. The
losses must equal plain training's.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeweave.models import ModelSpec
from pipeweave.runtime.plain import run_plain

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_torchrun_nodes_on_loopback_train_exactly(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun is not None, "torchrun is installed with torch"
    port = _free_port()
    record = tmp_path / "record.json"
    train = ["-m", "pipeweave.cli", "train", "-s", "1f1b", "--stages", "2", "--microbatches", "3", "--model", "mlp",
             "--layers", "4", "--hidden", "8", "--batch", "7", "--steps", "3", "--quiet", "--out", str(tmp_path),
             "--json", str(record)]
    nodes = [
        subprocess.Popen(
            [torchrun, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
             "--master-addr", "127.0.0.1", "--master-port", str(port), *train],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        )
        for n in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=150)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [n.returncode for n in nodes] == [0, 0], outputs
    report = json.loads(record.read_text())
    plain = run_plain(ModelSpec(kind="mlp", layers=4, hidden=8), steps=3, batch_size=7, num_microbatches=3)
    assert report["losses"] == pytest.approx(plain.losses, rel=1e-5)
    assert report["stages"] == 2 and len(report["weight_bytes"]) == 2

