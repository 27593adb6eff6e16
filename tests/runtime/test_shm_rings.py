"""Shared-memory rings only where messages go, sized by them, made with their failure caught.

- ``message_pairs`` is exactly the pairs of ranks the lowered schedule sends between, for every schedule;
- a run's rings (``sizes.message_rings``) connect neighbouring stages in each pipeline, tensor-parallel
  coordinate and replica, and the memory estimate counts each once;
- a ring whose mapping fails (an address-space limit reached in the middle of making them) ends the
  launch in one line, with no segment left in ``/dev/shm`` and no process left; ``--transport auto``
  falls back to gloo instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from config_defaults import train_config
from processes import descendants

from pipeweave.models import ModelSpec
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.memory import estimate_memory
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.sizes import message_rings
from pipeweave.runtime.transport import shm
from pipeweave.runtime.transport.mesh import process_pairs
from pipeweave.runtime.transport.order import message_pairs
from pipeweave.schedule import SCHEDULES, ScheduleError, generate, lower


def _sent_pairs(schedule: object) -> set[tuple[int, int]]:
    low = lower(schedule)  # type: ignore[arg-type]
    return {(rank, low.peer(a)) for rank, row in enumerate(low.actions) for a in row if a.op.is_send}


def test_message_pairs_are_the_pairs_the_lowered_schedule_sends_between() -> None:
    checked = 0
    for name in SCHEDULES:
        for d, t in ((2, 4), (4, 8), (3, 6)):
            try:
                schedule = generate(name, num_stages=d, num_microbatches=t)
            except (ScheduleError, TypeError, ValueError):
                continue
            assert message_pairs(schedule.placement) == _sent_pairs(schedule), (name, d, t)
            checked += 1
    assert checked >= 20


def test_a_run_has_rings_between_neighbours_only_and_its_estimate_counts_them() -> None:
    # The case: 16 ranks (4 stages x 4 data-parallel pipelines) of a 4-layer 32-wide mlp had 240 rings.
    config = train_config(
        schedule="1f1b",
        num_stages=4,
        num_microbatches=4,
        batch_size=64,
        data_parallel=4,
        model=ModelSpec(kind="mlp", layers=4, hidden=32),
    )
    plan = prepare(config)
    rings = message_rings(plan.config, plan.schedule, plan.num_processes)
    assert plan.num_processes == 16 and len(rings) == 4 * 6  # each pipeline: 3 links, both ways
    assert all(abs(a - b) == 1 and a // 4 == b // 4 for a, b in rings)
    assert set(rings.values()) == {shm.capacity_for(4 * 32 * 4)}  # microbatches of 4 samples, float32
    estimate = estimate_memory(plan, rings)
    assert sum(estimate.rings) == shm.ring_bytes(rings) < 32 << 20  # was 240 x 8 MiB
    assert estimate_memory(plan).rings == (0,) * 16


def test_tensor_parallel_and_replicas_around_a_stream_have_rings_of_their_own() -> None:
    assert process_pairs({(0, 1), (1, 0)}, stage_ranks=2, tensor_parallel=2, replicas=2) == {
        (0, 2),
        (2, 0),
        (1, 3),
        (3, 1),
        (4, 6),
        (6, 4),
        (5, 7),
        (7, 5),
    }
    gpt = ModelSpec(kind="gpt", layers=4, hidden=16, heads=2, seq_len=8, tie_embeddings=True)
    stream = train_config(schedule="pipedream-2bw", num_stages=3, num_microbatches=3, batch_size=6, model=gpt)
    plan = prepare(stream)
    assert set(message_rings(plan.config, plan.schedule, plan.num_processes)) == {
        (0, 1),
        (1, 0),
        (1, 2),
        (2, 1),
        (0, 2),
        (2, 0),  # the tied ends too: a stream's halves go point to point
    }
    synchronous = prepare(replace(stream, schedule="1f1b"))  # a step's tie goes through the process group
    assert (0, 2) not in message_rings(synchronous.config, synchronous.schedule, synchronous.num_processes)


def test_rings_beyond_the_address_space_limit_are_unavailable(monkeypatch) -> None:
    import resource

    rings = shm.all_pairs(2, 64 << 20)
    assert shm.unavailable(rings) is None or "address-space" not in str(shm.unavailable(rings))
    real = resource.getrlimit

    def tight(what: int) -> tuple[int, int]:
        if what != resource.RLIMIT_AS:
            return real(what)
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
        return size + (100 << 20), real(what)[1]

    monkeypatch.setattr(resource, "getrlimit", tight)
    why = shm.unavailable(rings)
    if why is not None and why.startswith("the address-space"):
        assert re.fullmatch(r"the address-space limit \(ulimit -v\) leaves \d+ MiB, 256 MiB wanted for the rings", why)
    else:  # another reason came first (not x86-64, CUDA, /dev/shm too small)
        assert why is not None


def test_a_rank_that_cannot_map_its_rings_fails_in_one_line(monkeypatch) -> None:
    """A rank maps its rings in ``connect`` (inside its error handling), not while multiprocessing unpickles them."""
    import multiprocessing

    made = shm.make_channels(multiprocessing.get_context("spawn"), {(0, 1): 1 << 16})[(0, 1)]
    arrived = _arrived(made)
    assert arrived.buffer is None  # nothing mapped on arrival

    def fail(fd: int, size: int) -> None:
        raise RuntimeError(
            f"unable to mmap {size} bytes from file <filename not specified>: Cannot allocate memory (12)"
        )

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_fd_cpu", fail)
    with pytest.raises(shm.RingsFailed, match=r"^cannot make the shared-memory message rings: 1 ring needs 0.1 MiB"):
        shm.connect(1, {(0, 1): arrived})
    assert arrived._fd is None  # its descriptor closed
    monkeypatch.undo()
    transport = shm.connect(1, {(0, 1): _arrived(made)})
    made.buffer[200] = 7  # the same bytes in both
    assert transport.incoming[0].buffer is not None and int(transport.incoming[0].buffer[200]) == 7


def _arrived(made: shm.Channel) -> shm.Channel:
    """``made`` as a spawned rank unpickles it: its descriptor inherited, not yet mapped."""
    fd, size = made.buffer.untyped_storage()._share_fd_cpu_()

    class Inherited:  # in place of multiprocessing's DupFd
        def detach(self) -> int:
            return os.dup(fd)

    channel = shm.Channel.__new__(shm.Channel)
    channel.__setstate__({"capacity": made.capacity, "fd": Inherited(), "size": size, "ready": made.ready})
    return channel


# The launcher of `pipeweave train --transport shm`, its address space limited as it makes the rings: the first
# ring's plain allocation fits, its shared mapping does not -- torch then leaves its /dev/shm segment behind.
_LIMITED = textwrap.dedent(
    """
    import resource, sys
    from pipeweave import cli
    from pipeweave.runtime.transport import shm

    make = shm.make_channels

    def limited(ctx, rings):
        size = next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + max(rings.values()) * 3 // 2, resource.RLIM_INFINITY))
        return make(ctx, rings)

    shm.make_channels = limited
    sys.argv = ["pipeweave"] + sys.argv[1:]
    sys.exit(cli.main())
    """
)


@pytest.mark.slow  # 10-25 s: a CLI process and its fork server start
@pytest.mark.timeout(120)
def test_a_ring_that_cannot_be_mapped_ends_the_run_in_one_line_leaving_nothing(tmp_path: Path) -> None:
    command = [sys.executable, "-c", _LIMITED, "train", "--model", "mlp", "--layers", "4", "--hidden", "4096"]
    command += ["--batch", "512", "--microbatches", "2", "-s", "1f1b", "--steps", "1", "--transport", "shm"]
    command += ["--quiet", "--out", str(tmp_path)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    helpers: set[int] = set()
    while proc.poll() is None:  # the fork server and the resource tracker it starts first
        helpers |= set(descendants(proc.pid))
        time.sleep(0.05)
    _, err = proc.communicate()
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pipeweave: cannot make the shared-memory message rings: 2 rings need 26.0 MiB")
    assert "out of memory or address space (ulimit -v?); use --transport gloo" in lines[0]
    assert not list(Path("/dev/shm").glob(f"torch_{proc.pid}_*"))
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in helpers if Path(f"/proc/{p}").exists()]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_auto_falls_back_to_gloo_and_a_pair_without_a_ring_talks_over_the_group(monkeypatch) -> None:
    config = train_config(
        schedule="1f1b", num_stages=3, num_microbatches=3, batch_size=6, model=ModelSpec(kind="mlp", layers=3, hidden=8)
    )
    plan = prepare(config)
    some = {(0, 1): 1 << 16, (1, 0): 1 << 16}  # rank 1 -> 2 and 2 -> 1 over gloo
    partly = launch(run_rank_transport, plan, 3, LaunchOptions(transport="shm", shm_rings=some))

    def fail(ctx: object, rings: shm.Rings) -> None:
        raise shm.RingsFailed("no rings")

    monkeypatch.setattr(shm, "make_channels", fail)
    fallen = launch(run_rank_transport, plan, 3, LaunchOptions(transport="auto"))
    assert partly[0] == "shm" and fallen[0] != "shm"
    assert partly[1] == fallen[1]  # the same losses either way


def test_the_fork_server_leaves_without_finalizing_torch(tmp_path: Path) -> None:
    """A killed launcher's run was gone only once its fork server had finalized torch (2.4-5 s under load,
    benchmarks/cleanup/README.md): the server's last preload makes it leave through ``os._exit`` at once."""
    import multiprocessing.forkserver

    from pipeweave.runtime.run import forkserver

    forkserver.context()
    preload = multiprocessing.forkserver._forkserver._preload_modules  # type: ignore[attr-defined]
    assert preload[-1] == "pipeweave.runtime.run.forkserver_exit"
    marker = tmp_path / "finalized"
    script = (
        "import atexit, pathlib, sys\n"
        f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'x')  # an earlier handler: runs after\n"
        "import pipeweave.runtime.run.forkserver_exit\n"
        "print('flushed', end='')\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "flushed") and not marker.exists()


def run_rank_transport(context: object, plan: object) -> tuple[str, list[float]] | None:
    """Rank 0's transport and losses (``run_rank`` returns the record on rank 0 alone)."""
    from pipeweave.runtime.run.job import run_rank

    record = run_rank(context, plan)  # type: ignore[arg-type]
    return None if record is None else (record.transport, list(record.losses))


pytestmark = [pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")]
