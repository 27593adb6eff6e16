"""F&B pairs at run time: the B half's receives go out before the F half, results are unchanged, and with every
message delayed (``--comm-delay-ms``) the overlapped DualPipe step is shorter, as the simulator predicts."""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import threading
import time
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.report.trace import chrome_trace, profile_costs
from pipeweave.runtime.run.prepare import build_schedule
from pipeweave.runtime.transport.delay import DelayedWork, delayed
from pipeweave.runtime.transport.order import message_key
from pipeweave.runtime.transport.p2p import P2P
from pipeweave.schedule import generate, lower
from pipeweave.sim import compute_metrics, simulate
from pipeweave.training import train


class _Work:
    """A transfer that completes when ``done`` is set (or raises ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.done, self.error = threading.Event(), error

    def wait(self, timeout: Any = None) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


def test_a_delayed_message_completes_the_delay_after_its_transfer() -> None:
    work = _Work()
    slow = DelayedWork(work, 0.1)
    time.sleep(0.05)
    assert not slow.is_completed()  # the transfer itself has not completed
    work.done.set()
    begin = time.monotonic()
    slow.wait()
    assert 0.07 < time.monotonic() - begin < 0.5 and slow.is_completed()


def test_a_delay_runs_beside_the_ranks_compute() -> None:
    work = _Work()
    work.done.set()
    slow = DelayedWork(work, 0.1)
    time.sleep(0.15)  # "compute" longer than the delay: the wait costs nothing
    begin = time.monotonic()
    slow.wait()
    assert time.monotonic() - begin < 0.03


def test_a_failed_or_late_transfer_fails_the_wait() -> None:
    failed = _Work(RuntimeError("peer gone"))
    failed.done.set()
    with pytest.raises(RuntimeError, match="peer gone"):
        DelayedWork(failed, 0.01).wait()
    with pytest.raises(RuntimeError, match="did not arrive"):
        DelayedWork(_Work(), 0.01).wait(datetime.timedelta(seconds=0.05))
    assert delayed(None, 1.0) is None and delayed(failed, 0.0) is failed


@pytest.mark.parametrize("overlap", [True, False])
def test_the_b_halfs_receive_is_posted_before_the_f_half(overlap: bool) -> None:
    schedule = generate("dualpipe", num_stages=2, num_microbatches=4, overlap_fb=overlap)
    lowered = lower(schedule)
    row = lowered.actions[0]
    f, b = next((f, b) for f, b in generate("dualpipe", num_stages=2, num_microbatches=4).pairs if f in row)
    receive = row[row.index(b) - 1]  # 0RECV_B0, right before the B half
    p2p = P2P(lowered, 0, [1] * 4, torch.device("cpu"))
    posted_before_f = {key for _, key in p2p._ahead[row.index(f) - 1]}
    assert (message_key(lowered, receive) in posted_before_f) == overlap


def test_comm_delay_needs_gloo_and_the_overlap_flag_dualpipe() -> None:
    with pytest.raises(UserError, match="--comm-delay-ms 50 .* give --transport gloo"):
        train_config(comm_delay_ms=50.0)
    with pytest.raises(UserError, match="--comm-delay-ms -1 is invalid"):
        train_config(comm_delay_ms=-1.0, transport="gloo")
    with pytest.raises(UserError, match="--no-overlap-fb applies to dualpipe, dualpipe-v, not 1f1b"):
        train_config(schedule="1f1b", overlap_fb=False)


def _makespans(record: Any) -> list[float]:
    """Per recorded step after the first, its first start to its last end over every rank (seconds)."""
    steps = min(len(r.records) for r in record.ranks)
    return [
        max(r.records[k][-1][4] for r in record.ranks) - min(r.records[k][0][3] for r in record.ranks)
        for k in range(1, steps)
    ]


DELAY_MS = 80.0


def _run(overlap: bool, out: str) -> tuple[Any, Any]:
    config = train_config(
        schedule="dualpipe",
        num_stages=2,
        num_microbatches=4,
        model=ModelSpec(kind="mlp", layers=8, hidden=16),
        batch_size=7,  # the last microbatch smaller
        steps=5,
        transport="gloo",
        comm_delay_ms=DELAY_MS,
        overlap_fb=None if overlap else False,
        collect_parameters=True,
        quiet=True,
        out=out,
    )
    return train(config), build_schedule(config)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_overlapped_dualpipe_hides_the_delay_and_the_simulator_predicts_both(tmp_path: Any) -> None:
    (serial, serial_schedule), (paired, schedule) = _run(False, str(tmp_path / "a")), _run(True, str(tmp_path / "b"))
    assert paired.losses == serial.losses  # exact: the same order of compute
    for a, b in zip(serial.ranks, paired.ranks):
        for stage, params in a.parameters.items():
            assert all(torch.equal(params[n], b.parameters[stage][n]) for n in params)
    pairs = len(schedule.pairs) / schedule.num_ranks  # 1 on each rank at D=2, T=4
    measured = [statistics.median(_makespans(r)) for r in (serial, paired)]
    assert measured[0] - measured[1] >= 0.5 * DELAY_MS / 1000 * pairs, measured
    predicted = []
    for record, s in ((serial, serial_schedule), (paired, schedule)):
        cost = dataclasses.replace(profile_costs(s, record, comm=DELAY_MS / 1000), comm_rendezvous=True)
        predicted.append(compute_metrics(simulate(s, cost)).makespan)
    assert predicted[0] - predicted[1] >= 0.5 * DELAY_MS / 1000 * pairs, predicted
    for m, p in zip(measured, predicted):
        assert abs(m - p) < 0.4 * p, (measured, predicted)
    # the measured trace shows each pair, and that its B half's message had arrived (the delay hidden)
    exposed = [e["args"]["exposed_us"] for e in chrome_trace(schedule, paired)["traceEvents"] if e.get("cat") == "F&B"]
    assert exposed and statistics.median(exposed) < 0.5 * DELAY_MS * 1000
