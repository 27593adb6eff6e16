"""``--transport shm``: the shared-memory rings train exactly like plain training, and fail fast.

Each rank also reports how many bytes it wrote into each ring, so a run that
silently fell back to gloo fails the test.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, RankFailure, launch
from pipeweave.runtime.run.prepare import build_schedule, optimizer_factory, prepare
from pipeweave.runtime.run.sizes import largest_message_bytes, message_rings
from pipeweave.runtime.transport import shm
from pipeweave.schedule import ScheduleError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

STEPS = 2
SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b", "chimera")


def _config(name: str, ranks: int) -> TrainConfig | None:
    for t in (4, 6, 8):
        config = train_config(
            schedule=name,
            num_stages=ranks,
            num_microbatches=t,
            batch_size=2 * t - 1,
            steps=STEPS,
            model=ModelSpec(kind="mlp", layers=4 * ranks, hidden=8),
            collect_parameters=True,
        )
        try:
            if prepare(config).schedule.num_ranks == ranks:
                return config
        except ScheduleError:
            continue
    return None


def _tied_gpt() -> TrainConfig:
    gpt = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8, tie_embeddings=True)
    return train_config(
        schedule="1f1b", num_stages=2, num_microbatches=3, model=gpt, batch_size=5, steps=STEPS, collect_parameters=True
    )


def _run_all(context: RankContext, configs: list[TrainConfig]) -> tuple[list[Any], list[int]]:
    world = context.world
    records = [run_rank(context, prepare(c)) for c in configs]
    ring = context.transport
    written = [] if ring is None else [int(c.ctrl[0]) for _, c in sorted(ring.outgoing.items())]
    written_all = [torch.zeros(world - 1, dtype=torch.int64) for _ in range(world)]
    torch.distributed.all_gather(written_all, torch.tensor(written or [0] * (world - 1)))
    return records, [int(v) for t in written_all for v in t]


@pytest.mark.parametrize("ranks", (2, 3))
def test_shm_runs_equal_plain_training(ranks: int) -> None:
    configs = {n: c for n in SCHEDULES if (c := _config(n, ranks)) is not None}
    assert {"1f1b", "zb-h1", "interleaved-1f1b"} <= set(configs)
    if ranks == 2:
        configs["gpt-tied"] = _tied_gpt()
    records, written = launch(_run_all, list(configs.values()), ranks, LaunchOptions(transport="shm"))
    assert all(w > 0 for w in written), written  # every rank sent to every peer through its ring
    for (name, config), record in zip(configs.items(), records):
        if name == "gpt-tied":
            continue
        plain = run_plain(
            config.model,
            steps=STEPS,
            batch_size=config.batch_size,
            num_microbatches=config.num_microbatches,
            optimizer_factory=optimizer_factory(config),
        )
        torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6, msg=name)
        seen = set()
        for rank_record in record.ranks:
            for params in rank_record.parameters.values():
                for pname, value in params.items():
                    torch.testing.assert_close(value, plain.parameters[pname], rtol=1e-5, atol=1e-6, msg=name)
                    seen.add(pname)
        assert seen == set(plain.parameters), name
    if ranks == 2:  # the tied gpt: bitwise the same as over gloo (the tied exchange itself stays on gloo)
        gloo, _ = launch(_run_all, [configs["gpt-tied"]], 2, LaunchOptions(transport="gloo"))
        assert records[-1].losses == gloo[0].losses
        for ours, theirs in zip(records[-1].ranks, gloo[0].ranks, strict=True):
            assert ours.parameters.keys() == theirs.parameters.keys()
            for stage, params in theirs.parameters.items():
                for pname, value in params.items():
                    assert torch.equal(ours.parameters[stage][pname], value), pname


def _fail_in_backward(context: RankContext, config: TrainConfig, hang: bool) -> Any:
    rank = context.process
    if rank == 1:
        from pipeweave.runtime.stage.worker import StageWorker

        original, calls = StageWorker.backward, [0]

        def backward(self: StageWorker, mb: int, grad_output: torch.Tensor | None = None) -> Any:
            calls[0] += 1
            if calls[0] == 6:  # inside the second step: rank 0 is blocked on a ring
                if hang:  # alive but silent: only rank 0's own wait can end the run
                    time.sleep(60)
                raise RuntimeError("injected failure on rank 1")
            return original(self, mb, grad_output)

        StageWorker.backward = backward  # type: ignore[method-assign]
    return run_rank(context, prepare(config))


def _raise_in_backward(context: RankContext, config: TrainConfig) -> Any:
    return _fail_in_backward(context, config, hang=False)


def _hang(context: RankContext, config: TrainConfig) -> Any:
    return _fail_in_backward(context, config, hang=True)


@pytest.mark.parametrize(
    "fn, timeout_s, cause",
    [
        (_raise_in_backward, 60.0, "rank 1 failed: RuntimeError: injected failure on rank 1"),
        (
            _hang,
            3.0,
            "rank 0 failed: StuckError: rank 0 stuck at its action 8 (0RECV_B1): rank 0: no shm message for 3 s",
        ),
    ],
)
def test_a_failure_ends_every_rank_quickly(fn: Any, timeout_s: float, cause: str) -> None:
    config = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=4,
        batch_size=8,
        steps=50,
        model=ModelSpec(kind="mlp", layers=2, hidden=8),
    )
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(fn, config, 2, LaunchOptions(transport="shm", timeout_s=timeout_s, quiet_errors=True))
    assert failure.value.cause.startswith(cause), failure.value.cause
    assert time.monotonic() - start < 25


def test_a_small_ring_wraps_queues_and_keeps_order() -> None:
    """Both ends in one process: records wrap, pad and queue behind a full ring, arriving intact in order."""
    import multiprocessing

    channels = shm.make_channels(multiprocessing.get_context("spawn"), shm.all_pairs(2, 1024))
    sender, receiver = shm.ShmTransport(0, channels), shm.ShmTransport(1, channels)
    sizes = [7, 100, 50, 1, 200, 3, 90, 64, 150, 5] * 3  # float32: 28 to 800 bytes, records of 128 to 896
    sent = [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(sizes)]
    works = [sender.isend(t, 1, tag=i) for i, t in enumerate(sent)]
    assert works[0].is_completed() and not works[-1].is_completed()  # the ring is full: queued, not blocked
    for i, n in enumerate(sizes):
        got = receiver.irecv(torch.empty(n), 0, tag=i)
        sender.flush(1)  # room freed by the receiver lets queued records in
        got.wait()
        assert torch.equal(got.buffer, sent[i]), i
    assert all(w.is_completed() for w in works)
    assert int(channels[0, 1].ctrl[0]) > 3 * 1024  # it went around the ring more than three times


def test_a_message_larger_than_the_ring_streams_through_in_records() -> None:
    import multiprocessing

    channels = shm.make_channels(multiprocessing.get_context("spawn"), shm.all_pairs(2, 1024))
    sender, receiver = shm.ShmTransport(0, channels), shm.ShmTransport(1, channels)
    big = torch.arange(3000, dtype=torch.float64)  # 24,000 bytes through a 1,024-byte ring: 94 records of 256
    small = torch.tensor([7, 8], dtype=torch.int32)
    empty = torch.empty(0)
    works = [sender.isend(big, 1, tag=1), sender.isend(small, 1, tag=2), sender.isend(empty, 1, tag=3)]
    got = [receiver.irecv(torch.empty_like(t), 0, tag=i + 1) for i, t in enumerate((big, small, empty))]
    for _ in range(200):
        sender.flush(1)
        receiver.progress(0)
    assert all(w.is_completed() for w in works) and all(g.is_completed() for g in got)
    assert torch.equal(got[0].buffer, big) and torch.equal(got[1].buffer, small) and got[2].buffer.numel() == 0


ASYNC = ("pipedream", "pipemare", "spectrain", "avgpipe")


def test_shm_carries_asynchronous_streams_exactly() -> None:
    """A stream is one long step for the transport: the rings carry it, equal to the reference executor."""
    from pipeweave.runtime.reference import run_reference

    configs = [
        train_config(
            schedule=name,
            num_stages=2,
            num_microbatches=4,
            batch_size=7,
            steps=4,
            lr=0.05,
            momentum=0.9,
            model=ModelSpec(kind="mlp", layers=4, hidden=8),
            collect_parameters=True,
        )
        for name in ASYNC
    ]
    records, written = launch(_run_all, configs, 2, LaunchOptions(transport="shm"))
    assert all(w > 0 for w in written), written
    for config, record in zip(configs, records, strict=True):
        assert record.transport == "shm"
        reference = run_reference(
            build_schedule(config),
            config.model,
            steps=config.steps,
            batch_size=config.batch_size,
            optimizer_factory=optimizer_factory(config),
        )
        torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6, msg=config.schedule)
        for rank_record in record.ranks:
            for stage, params in rank_record.parameters.items():
                for pname, value in params.items():
                    torch.testing.assert_close(
                        value, reference.stage_parameters[stage][pname], rtol=1e-5, atol=1e-6, msg=config.schedule
                    )


def test_auto_takes_shm_here_and_gloo_when_asked() -> None:
    config = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        batch_size=4,
        steps=1,
        model=ModelSpec(kind="mlp", layers=2, hidden=8),
    )
    auto = launch(run_rank, prepare(config), 2, LaunchOptions(transport="auto"))
    gloo = launch(run_rank, prepare(config), 2, LaunchOptions(transport="gloo"))
    assert auto.transport == ("shm" if shm.unavailable(shm.all_pairs(2)) is None else "gloo")
    assert gloo.transport == "gloo"
    assert auto.losses == gloo.losses


def test_rings_are_sized_for_the_largest_message() -> None:
    mlp = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=4,
        batch_size=30,
        model=ModelSpec(kind="mlp", layers=4, hidden=64),
    )
    assert largest_message_bytes(mlp) == 8 * 64 * 4  # microbatches of 8, 8, 7, 7 samples
    gpt = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        batch_size=64,
        model=ModelSpec(kind="gpt", layers=2, hidden=512, heads=8, seq_len=256),
    )
    assert largest_message_bytes(gpt) == 32 * 256 * 512 * 4  # 16 MiB
    sp = replace(gpt, tensor_parallel=2, sequence_parallel=True)  # each process sends its half of the sequence
    assert largest_message_bytes(sp) == 32 * 128 * 512 * 4
    assert shm.capacity_for(16 << 20) == 49 << 20 and shm.capacity_for(100) == (1 << 20) + 300
    assert shm.capacity_for(1 << 40) == shm.MAX_CAPACITY  # a larger message streams through in records
    rings = message_rings(gpt, prepare(gpt).schedule, 2)
    assert rings == {(0, 1): 49 << 20, (1, 0): 49 << 20}
    chimera = train_config(
        schedule="chimera",
        num_stages=2,
        num_microbatches=2,
        batch_size=4,
        model=ModelSpec(kind="mlp", layers=4, hidden=64),
    )
    assert largest_message_bytes(chimera) == 2 * 64 * 4  # a part's gradient is summed by a collective, not sent


def test_shm_is_refused_in_one_line_where_it_cannot_run() -> None:
    import argparse

    from pipeweave.commands.train_run import _check_transport
    from pipeweave.errors import UserError

    schedule = prepare(
        train_config(
            schedule="1f1b",
            num_stages=2,
            num_microbatches=2,
            batch_size=4,
            model=ModelSpec(kind="mlp", layers=2, hidden=8),
        )
    ).schedule
    with pytest.raises(
        UserError,
        match="^--transport shm needs ranks spawned by pipeweave on one host, not torchrun; use --transport gloo$",
    ):
        _check_transport(argparse.Namespace(transport="shm"), schedule, torchrun=True)
    _check_transport(argparse.Namespace(transport="auto"), schedule, torchrun=True)  # auto: gloo, no error
    assert shm.unavailable(shm.all_pairs(2, 1 << 60)) is not None  # no /dev/shm holds that


def test_a_queued_message_keeps_its_tensor_alive_and_odd_tensors_are_refused() -> None:
    """Payloads move by address: a queued send holds its tensor until written; no strided tensor is read raw."""
    import gc
    import multiprocessing

    channels = shm.make_channels(multiprocessing.get_context("spawn"), shm.all_pairs(2, 1024))
    sender, receiver = shm.ShmTransport(0, channels), shm.ShmTransport(1, channels)
    works = [sender.isend(torch.full((100,), float(i)), 1, tag=i) for i in range(6)]  # 400 bytes each: 2 fit
    assert not works[-1].is_completed()
    gc.collect()  # the caller kept no reference to the queued tensors
    for i in range(6):
        got = receiver.irecv(torch.empty(100), 0, tag=i)
        sender.flush(1)
        got.wait()
        assert torch.equal(got.buffer, torch.full((100,), float(i))), i
    with pytest.raises(ValueError, match="contiguous"):
        sender.isend(torch.ones(4, 3).t(), 1, tag=9)
    odd = shm.make_channels(multiprocessing.get_context("spawn"), shm.all_pairs(2, 1000))  # rounded to whole records
    assert odd[0, 1].capacity == 1024
    sender, receiver = shm.ShmTransport(0, odd), shm.ShmTransport(1, odd)
    for i in range(5):
        sender.isend(torch.full((60,), float(i)), 1, tag=i)  # 240 bytes: records wrap around the ring
        got = receiver.irecv(torch.empty(60), 0, tag=i)
        got.wait()
        assert torch.equal(got.buffer, torch.full((60,), float(i)))


def test_a_stream_refuses_a_tensor_unlike_the_one_it_announced() -> None:
    import multiprocessing

    from pipeweave.runtime.transport.p2p import P2P
    from pipeweave.schedule import generate, lower
    from pipeweave.schedule.ir import Action, Op

    context = RankContext(
        transport=shm.connect(0, shm.make_channels(multiprocessing.get_context("spawn"), shm.all_pairs(2, 1 << 16)))
    )
    p2p = P2P(
        lower(generate("1f1b", num_stages=2, num_microbatches=3)), 0, [2, 2, 1], torch.device("cpu"), context=context
    )
    p2p.begin_step()
    p2p.send(Action(0, Op.SEND_F, 0), torch.ones(2, 4))
    with pytest.raises(ValueError, match="per-sample shape"):
        p2p.send(Action(0, Op.SEND_F, 1), torch.ones(2, 5))
    with pytest.raises(ValueError, match="announced as torch.float32"):
        p2p.send(Action(0, Op.SEND_F, 1), torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not have the microbatch"):
        p2p.send(Action(0, Op.SEND_F, 2), torch.ones(2, 4))
    p2p.send(Action(0, Op.SEND_F, 1), torch.ones(4, 2).t())  # strided: sent as a contiguous copy
    p2p.send(Action(0, Op.SEND_F, 2), torch.ones(1, 4))  # the smaller last microbatch


def test_a_received_message_is_not_kept_by_the_transport() -> None:
    """Once its consumer lets go, a received activation is freed (a stream receives thousands of them)."""
    import gc
    import multiprocessing
    import weakref

    from pipeweave.runtime.transport.message import tensor_meta
    from pipeweave.runtime.transport.p2p import P2P
    from pipeweave.schedule import generate, lower
    from pipeweave.schedule.ir import Action, Op

    channels = shm.make_channels(multiprocessing.get_context("spawn"), shm.all_pairs(2, 1 << 16))
    sender = shm.ShmTransport(0, channels)
    context = RankContext(transport=shm.connect(1, channels))
    p2p = P2P(
        lower(generate("1f1b", num_stages=2, num_microbatches=2)), 1, [3, 3], torch.device("cpu"), context=context
    )
    p2p.begin_step()
    sender.isend(tensor_meta(torch.ones(3, 4)), 1, tag=p2p.tag((0, 0, -1)))
    for j in range(2):
        sender.isend(torch.full((3, 4), float(j)), 1, tag=p2p.tag((0, 0, j)))
    alive = []
    for j in range(2):
        x = p2p.recv(Action(1, Op.RECV_F, j))
        assert torch.equal(x, torch.full((3, 4), float(j)))
        alive.append(weakref.ref(x))
        del x
    gc.collect()
    assert all(ref() is None for ref in alive)
