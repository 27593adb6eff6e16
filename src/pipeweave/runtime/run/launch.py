"""Start the ranks of a run: spawn local processes, or join a ``torchrun`` group.

``launch(fn, payload, num_ranks)`` runs ``fn(context, payload)`` on every rank
of a gloo (CPU) or NCCL (CUDA) process group and returns rank 0's result;
``context`` is the rank's ``runtime.context.RankContext`` (its process and the
run's size, its device, wait timeout, progress sink and transport), built here
and passed down. Two ways in:

- **spawned** (the default): the launcher hosts the rendezvous store on
  127.0.0.1 (a free port chosen by the OS, no race), starts one process per
  rank and watches them. The first failure -- an exception, a process that
  dies, Ctrl-C, SIGTERM or SIGHUP to the launcher -- terminates every other
  rank at once, prints the cause once and raises ``RankFailure`` (exit code
  1, or 128 + the signal's number). A run that diverged (``errors.Diverged``,
  raised by every rank at the same step), or whose ranks chose different
  splits (``errors.RanksDisagree``), is reported by its message alone.
  Children ignore SIGINT and SIGHUP (the launcher owns them) and die with the
  launcher however it ends (SIGKILL, the OOM killer:
  ``process.die_with_process``); the fork server they came from leaves with
  the launcher, at once (``forkserver_exit``), so nothing is left behind:
  within about a second of a SIGKILL (benchmarks/cleanup/README.md). The
  shared-memory rings (``shm``, made here before spawning: a failure is one
  line) leave no segment in ``/dev/shm`` once mapped; their semaphores go
  with the launcher, or with multiprocessing's resource tracker if it was killed.
- **torchrun** (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set): the process
  joins the existing group; torchrun's agents watch the processes and the
  process-group timeout ends ranks whose peer on another node vanished.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.errors import Diverged, RanksDisagree, StuckError
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.process import (
    device_for,
    die_with_parent,
    die_with_process,
    keep_freed_host_memory,
    start_time,
    under_torchrun,
)
from pipeweave.runtime.run import forkserver
from pipeweave.runtime.transport import shm
from pipeweave.runtime.transport.host import HostTransport

RankFn = Callable[[RankContext, Any], Any]
HOST_UNDER_NCCL = (
    "--transport host stages the messages of ranks pipeweave spawns on one GPU over a gloo group; under "
    "torchrun the group is NCCL's, one GPU per rank: drop --transport host"
)
ProgressFn = Callable[[int, Any], None]

_VERDICTS = (Diverged, RanksDisagree)  # raised by every rank alike: rank 0's message is the cause, as is
_GRACE_S = 2.0  # how long terminated ranks get before SIGKILL
_SETTLE_S = 0.3  # after a first failure, how long to wait for a likelier root cause
# What the launcher says when a signal ends the run; SIGTERM and SIGHUP (an ssh
# terminal closed) stop every rank as Ctrl-C does. Exit code: 128 + the number.
_STOPS = {
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGTERM: "terminated (SIGTERM)",
    signal.SIGHUP: "hung up (SIGHUP)",
}


class _Stop(BaseException):
    """SIGTERM or SIGHUP reached the launcher (raised in its main thread, as Ctrl-C raises KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class RankFailure(RuntimeError):
    """A rank failed, or the ranks could not be started; ``cause`` is the one line printed for the user."""

    def __init__(self, cause: str, exit_code: int = 1) -> None:
        super().__init__(cause)
        self.cause, self.exit_code = cause, exit_code


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How ranks are started."""

    threads: int = 1
    """Intra-op threads per rank (``torch.set_num_threads``)."""
    timeout_s: float = 60.0
    """Process-group timeout: a rank blocked this long on a vanished peer fails."""
    quiet_errors: bool = False
    """Do not print the cause (the caller reports it)."""
    transport: str = "gloo"
    """Point-to-point messages of spawned ranks: ``gloo``, ``shm`` (``runtime.transport.shm``; collectives stay on gloo),
    ``host`` (``runtime.transport.host``: ranks sharing a GPU, a gloo group, messages staged through host memory),
    or ``auto``: ``shm`` where ``shm.unavailable`` finds nothing against it, else gloo (NCCL on CUDA)."""
    shm_capacity: int | None = None
    """Bytes of each shared-memory ring where ``shm_rings`` is not given (default ``shm.DEFAULT_CAPACITY``)."""
    shm_rings: shm.Rings | None = None
    """The shared-memory rings to make, ``(sender process, receiver process) -> bytes``: the pairs that exchange
    messages (``transport.order.message_pairs``), each sized by ``shm.capacity_for``; a pair without a ring
    talks over the process group. None: every ordered pair, ``shm_capacity`` bytes each."""
    keep_host_memory: bool = True
    """Keep freed host memory for reuse in each rank (``keep_freed_host_memory``)."""


def launch(
    fn: RankFn,
    payload: Any,
    num_ranks: int,
    options: LaunchOptions | None = None,
    on_progress: ProgressFn | None = None,
) -> Any:
    """Run ``fn(context, payload)`` on ``num_ranks`` ranks; return rank 0's result.

    Under torchrun every process returns its own result (None on ranks > 0 by
    convention of ``fn``), and only rank 0's own progress reaches ``on_progress``.

    Raises:
        RankFailure: a rank raised, died or the run was interrupted, or the shared-memory rings asked for
            could not be made.

    Example:
        >>> launch(lambda context, p: context.process, None, 1)  # doctest: +SKIP
        0
    """
    options = options or LaunchOptions()
    if under_torchrun():
        return _join_torchrun(fn, payload, num_ranks, options, on_progress)
    return _spawn(fn, payload, num_ranks, options, on_progress)


# ---- torchrun ----------------------------------------------------------------
def _join_torchrun(
    fn: RankFn, payload: Any, num_ranks: int, options: LaunchOptions, on_progress: ProgressFn | None
) -> Any:
    # If torchrun's agent is killed it cannot stop its workers: die with it, so the
    # other nodes' ranks fail on their peer timeout instead of training on forever.
    die_with_parent()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    sink = (lambda value: on_progress(0, value)) if rank == 0 and on_progress is not None else None
    if world != num_ranks:
        raise RankFailure(
            f"torchrun started {world} processes but the schedule needs {num_ranks} ranks; "
            f"give --nnodes x --nproc-per-node = {num_ranks}",
            2,
        )
    if options.transport == "host":
        raise RankFailure(HOST_UNDER_NCCL, 2)
    device = _prepare_rank(rank, options)
    ours = not dist.is_initialized()  # a script may have formed it first (pipelining: rank 0 chose the split)
    if ours:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=options.timeout_s),
        )
    try:
        value = fn(
            RankContext(
                process=rank,
                world=world,
                device=device,
                timeout=datetime.timedelta(seconds=options.timeout_s),
                sink=sink,
            ),
            payload,
        )
        # Every rank's last messages (the gather to rank 0) must have left before the
        # group goes: tearing gloo down under an in-flight op aborts the process
        # ("terminate called without an active exception"), seen under CPU contention.
        dist.barrier()
        return value
    except Exception as exc:  # one line per failing rank; torchrun's agent reports the exit
        cause = _describe(rank, exc)
        if rank == 0 or not isinstance(exc, _VERDICTS):  # every rank raises it alike: rank 0 says it
            _report(cause, options, _detail(exc))
        raise RankFailure(cause, 1) from None
    finally:
        if ours:
            dist.destroy_process_group()


def _prepare_rank(rank: int, options: LaunchOptions) -> torch.device:
    """This process as ``rank`` before its group exists: threads, host allocator, its device."""
    torch.set_num_threads(options.threads)
    if options.keep_host_memory:
        keep_freed_host_memory()
    device = device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def exit_torchrun_rank(code: int) -> None:
    """End a torchrun rank whose work is done (group destroyed, outputs written) without finalization.

    A spawned rank leaves through ``os._exit`` (multiprocessing's own way), a
    torchrun rank through the interpreter's finalization, where a gloo rank
    was seen to abort now and then ("terminate called without an active
    exception", exit -6) after its training had finished -- and its node's
    agent then waited out the elastic exit barrier (300 s) for the other
    node. Streams are flushed first; nothing else is left to run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- spawned ranks -----------------------------------------------------------
def _spawn(fn: RankFn, payload: Any, num_ranks: int, options: LaunchOptions, on_progress: ProgressFn | None) -> Any:
    store = dist.TCPStore("127.0.0.1", 0, num_ranks + 1, is_master=True, wait_for_workers=False)
    ctx = forkserver.context()
    procs: list[Any] = []
    previous = {sig: signal.getsignal(sig) for sig in _STOPS}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if previous[sig] != signal.SIG_IGN:  # under nohup SIGHUP stays ignored
            signal.signal(sig, _raise_stop)
    try:  # from the fork server's start on: a Ctrl-C held back while it starts arrives as it is unblocked
        forkserver.start_helpers()
        results: Any = ctx.SimpleQueue()
        # The channels are kept here: a started Process drops its arguments before the rank has unpickled them.
        procs, channels = _rank_processes(ctx, fn, payload, num_ranks, store.port, options, results)
        for p in procs:
            p.start()
        return _watch(procs, results, options, on_progress)
    except (KeyboardInterrupt, _Stop) as stop:
        signum = stop.signum if isinstance(stop, _Stop) else signal.SIGINT
        _terminate(procs)
        if len(procs) < num_ranks or any(p.pid is None for p in procs):  # stopped while starting them
            forkserver.stop_fork_server()
        _report(f"{_STOPS[signum]}; every rank was stopped", options)
        raise RankFailure(_STOPS[signum], 128 + signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _terminate(procs)
        del store


def _rank_processes(
    ctx: Any, fn: RankFn, payload: Any, num_ranks: int, port: int, options: LaunchOptions, results: Any
) -> tuple[list[Any], Any]:
    """One (unstarted) process per rank, and the shared-memory channels they will talk over, if any."""
    channels = _channels(ctx, num_ranks, options)
    launcher = (os.getpid(), start_time(os.getpid()))  # whom the ranks die with
    return [
        ctx.Process(
            target=_child,
            args=(fn, payload, rank, num_ranks, port, options, results, _own(channels, rank), launcher),
            daemon=True,
            name=f"pipeweave-rank{rank}",
        )
        for rank in range(num_ranks)
    ], channels


def _channels(ctx: Any, num_ranks: int, options: LaunchOptions) -> dict[tuple[int, int], shm.Channel] | None:
    """The shared-memory rings of the launch, made here before spawning; None: the process group carries the
    messages (``gloo``, or ``auto`` where rings cannot be used or made).

    Raises:
        RankFailure: ``shm`` was asked for and a ring could not be made (its one line printed).
    """
    if options.transport not in ("shm", "auto"):
        return None
    rings = options.shm_rings
    if rings is None:
        rings = shm.all_pairs(num_ranks, options.shm_capacity or shm.DEFAULT_CAPACITY)
    if options.transport == "auto" and shm.unavailable(rings) is not None:
        return None
    try:
        return shm.make_channels(ctx, rings)
    except shm.RingsFailed as failure:
        if options.transport == "auto":
            return None
        _report(str(failure), options)
        raise RankFailure(str(failure), 1) from None


def _own(channels: dict[tuple[int, int], shm.Channel] | None, rank: int) -> dict[tuple[int, int], shm.Channel] | None:
    """The rings ``rank`` sends or receives on: a rank maps no other pair's."""
    return None if channels is None else {pair: c for pair, c in channels.items() if rank in pair}


def _raise_stop(signum: int, frame: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # once: the ranks are being stopped
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signum)


def _watch(procs: list[Any], results: Any, options: LaunchOptions, on_progress: ProgressFn | None) -> Any:
    """Wait for every rank; on the first failure stop the rest and raise."""
    done: dict[int, Any] = {}
    failures: list[tuple[int, str, bool, str]] = []  # (rank, cause, a consequence of another failure?, detail)
    first_failure = 0.0
    while len(done) < len(procs):
        while not results.empty():
            kind, rank, value = results.get()
            if kind == "ok":
                done[rank] = pickle.loads(value)
            elif kind == "progress":
                if on_progress is not None and not failures:
                    on_progress(rank, value)
            else:
                failures.append((rank, *value))
        for rank, p in enumerate(procs):
            if (
                rank not in done
                and p.exitcode is not None
                and p.exitcode != 0
                and not any(f[0] == rank for f in failures)
            ):
                failures.append((rank, _exit_cause(rank, p.exitcode), False, ""))
        if failures:
            first_failure = first_failure or time.monotonic()
            if time.monotonic() - first_failure >= _SETTLE_S:
                _terminate(procs)
                root = next((f for f in failures if not f[2]), failures[0])
                _report(root[1], options, root[3])
                raise RankFailure(root[1], 1)
        time.sleep(0.02)
    for p in procs:
        p.join(timeout=10)
    return done.get(0)


def _exit_cause(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


def _terminate(procs: list[Any]) -> None:
    alive = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in alive:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _report(cause: str, options: LaunchOptions, detail: str = "") -> None:
    """Print the cause of a failed run, once (and below it ``detail``: a stuck schedule's grid)."""
    if not options.quiet_errors:
        try:
            print(f"pipeweave: {cause}" + (f"\n{detail}" if detail else ""), file=sys.stderr, flush=True)
        except OSError:  # the terminal is gone (SIGHUP): the exit code still tells
            pass


def _detail(exc: BaseException) -> str:
    """What a failure shows beyond its one line: where a stuck schedule stopped (``StuckError.grid``)."""
    return exc.grid if isinstance(exc, StuckError) else ""


def _child(
    fn: RankFn,
    payload: Any,
    rank: int,
    world: int,
    port: int,
    options: LaunchOptions,
    results: Any,
    channels: Any,
    launcher: tuple[int, int | None],
) -> None:
    die_with_process(*launcher)  # first: the launcher may be gone already
    # Ctrl-C and a terminal's hangup reach the whole foreground process group; only the launcher acts on them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, forkserver.GROUP_SIGNALS)  # blocked since the fork server's start
    die_with_parent()
    try:
        device = _prepare_rank(rank, options)
        store = dist.TCPStore(
            "127.0.0.1", port, world + 1, is_master=False, timeout=datetime.timedelta(seconds=options.timeout_s)
        )
        dist.init_process_group(
            backend_for(device, options),
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=options.timeout_s),
        )
        context = RankContext(
            process=rank,
            world=world,
            device=device,
            timeout=datetime.timedelta(seconds=options.timeout_s),
            sink=lambda value: results.put(("progress", rank, value)),
            transport=_transport(rank, world, channels, options),
        )
        value = fn(context, payload)
        dist.barrier()  # nothing in flight when the group is destroyed (see _join_torchrun)
        # Plain pickle bytes: torch's queue pickler would share tensors through
        # file descriptors that vanish with this process.
        results.put(("ok", rank, pickle.dumps(value if rank == 0 else None)))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the launcher
        results.put(("error", rank, (_describe(rank, exc), _is_consequence(exc), _detail(exc))))
        sys.stderr.flush()
        os._exit(1)


def backend_for(device: torch.device, options: LaunchOptions) -> str:
    """The process group's backend: NCCL on CUDA, gloo on the CPU and for ``--transport host`` (ranks sharing
    a GPU, which NCCL refuses)."""
    return "nccl" if device.type == "cuda" and options.transport != "host" else "gloo"


def _transport(rank: int, world: int, channels: Any, options: LaunchOptions) -> Any:
    """What carries this spawned rank's messages besides its process group: the shared-memory rings, the
    host-staged transport, or nothing."""
    if options.transport == "host":
        return HostTransport(rank, world)
    return shm.connect(rank, channels) if channels is not None else None


def _describe(rank: int, exc: BaseException) -> str:
    if isinstance(exc, _VERDICTS):  # the run's verdict, the same on every rank: its own line
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"rank {rank} failed: {type(exc).__name__}: {first_line}{where}"


def _is_consequence(exc: BaseException) -> bool:
    """A communication error is usually the echo of another rank's failure."""
    if isinstance(exc, StuckError) and exc.__cause__ is not None:  # stuck on a receive: what ended it
        return _is_consequence(exc.__cause__)
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, dist.DistError) or any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out", "gloo")
    )
