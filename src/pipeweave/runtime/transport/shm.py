"""Shared-memory point-to-point transport for CPU ranks spawned on one host (``--transport auto|shm``).

``pipeweave train`` takes it by default (``--transport auto``) where
``unavailable`` finds nothing against it: a message costs less CPU through it
than through gloo (measured in benchmarks/runtime/README.md).

Per ordered pair of ranks that exchange messages (``transport.order.message_pairs``:
neighbours in a pipeline, not every pair), the launcher allocates before
spawning a byte ring in shared memory (a torch uint8 tensor) and a semaphore,
each ring sized for the largest message it carries (``capacity_for``), and
hands each rank its own rings alone. A ring that cannot be made (no memory,
an address-space limit) ends the launch in one line naming the bytes needed
(``RingsFailed``), with the rings made so far freed and no segment left in
``/dev/shm``. A pair without a ring (a caller's own ``rings``) talks over
the process group.

The sender copies each message into the ring as one record -- a 64-byte
header (tag, bytes) then the payload, 64-byte aligned, skipping to the
ring's start when it would not fit before its end -- advances the ``written`` counter and releases the semaphore;
the receiver copies the record out, advances ``read`` and acquires it once.
Both counters count bytes since the start and each has a single writer, so the
ring needs no lock. The receiver acquires the semaphore before it reads a
record, which orders the payload on any CPU; that the receiver's copy-out is done before
the sender sees ``read`` move relies on x86-64's ordering, so ``train``
accepts ``--transport shm`` on x86-64 only.

Records of a pair are read in the order they were written, which is the
per-pair posting order ``comm.rank_sends`` fixes on both sides -- the same
pairing as gloo and NCCL. The receiver knows every message's size before it
arrives (the shape handshake), so it finds the padding the sender skipped
without reading it; the header's tag and size are checked anyway.

A message larger than a quarter of the ring travels as several records of at
most that size, so any message streams through any ring.

Sends never block: a record that does not fit waits in this rank's own queue
and is written as the receiver frees room (at every later call and while the
rank waits). Waits block on the semaphore (in short slices while own sends
are queued) up to the launch's timeout; a dead peer ends the run sooner through the
launcher, which terminates every rank at the first failure.
"""

from __future__ import annotations

import ctypes
import datetime
import glob
import multiprocessing.reduction
import os
import platform
import resource
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

_CTRL = 128  # written (bytes) at offset 0, read at 64: separate cache lines
_HEADER = 64
_ALIGN = 64
_PAGE = 4096
_SLICE_S = 0.002  # blocking slice while own sends are queued behind a full ring
_memmove = ctypes.memmove
DEFAULT_CAPACITY = 8 << 20  # per ring where the caller knows no message size; any message size streams
MAX_CAPACITY = 256 << 20  # a larger message streams through in records (a quarter of the ring each)
_SLACK = 1 << 20  # headers and the padding skipped at the ring's end; the smallest ring

Rings = Mapping[tuple[int, int], int]
"""The rings of a launch: ``(sender, receiver) -> bytes`` of the ring."""


class RingsFailed(RuntimeError):
    """The rings could not be made; the message is one line with the bytes they need and the fix."""


class Channel:
    """One ordered pair's ring: ``buffer`` (control block then data) and its ``ready`` semaphore."""

    def __init__(self, ctx: Any, capacity: int) -> None:
        self.capacity = _whole(capacity)
        # Made in shared memory at once (zero-filled by the kernel): no private copy first, whose zero fill would
        # start OpenMP threads (libgomp aborts the process where it cannot, under an address-space limit).
        storage = torch.UntypedStorage._new_shared(_CTRL + self.capacity)
        self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.ready = ctx.Semaphore(0)
        self._views()

    def _views(self) -> None:
        # Plain memoryviews of the shared bytes: right after a compute action has evicted the
        # caches, a send's few control reads and writes cost less through them than as numpy
        # scalars or tensor ops (measured in benchmarks/runtime/README.md).
        self._array = self.buffer.numpy()
        whole = memoryview(self._array)
        self.ctrl = whole[:_CTRL].cast("q")
        self.data = whole[_CTRL:]
        self.words = self.data.cast("q")  # record headers, as 8-byte words (records are 64-byte aligned)
        self.chunk = _chunk(self.capacity)
        self.address = self.buffer.data_ptr() + _CTRL  # of the data, in this process: payloads move by memmove

    def map_pages(self) -> None:
        """Touch every page of the ring in this process, so messages do not pay a page fault per 4 KiB.

        A read: the peer may already be writing records.
        """
        int(self._array[_CTRL::_PAGE].sum())

    def __getstate__(self) -> dict[str, Any]:
        # The ring's descriptor, not the mapped ring: the rank maps it in ``attach``, inside its own error
        # handling (a mapping that fails is then the rank's one line, not a traceback of its bootstrap).
        fd, size = self.buffer.untyped_storage()._share_fd_cpu_()
        return {"capacity": self.capacity, "fd": multiprocessing.reduction.DupFd(fd), "size": size, "ready": self.ready}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.capacity, self.ready, self._size = state["capacity"], state["ready"], state["size"]
        self._fd: int | None = state["fd"].detach()
        self.buffer: torch.Tensor | None = None

    def attach(self) -> None:
        """Map the ring in this process, where it arrived pickled (``connect``); a no-op where it was made."""
        if self.buffer is not None:
            return
        assert self._fd is not None
        try:
            storage = torch.UntypedStorage._new_shared_fd_cpu(self._fd, self._size)
        finally:
            os.close(self._fd)
            self._fd = None
        self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._views()


def capacity_for(largest_message: int) -> int:
    """A ring that holds two of the largest messages at once: three messages' bytes plus 1 MiB, at most
    ``MAX_CAPACITY``.

    A message that does not fit waits, in part, for its sender's next call into
    the transport, which may come only after the sender's next compute action:
    sized so, back-to-back messages never wait on the receiver. Three messages'
    bytes plus 1 MiB: two messages, their headers and the padding skipped at
    the ring's end (less than one record, a quarter of the ring). Above
    ``MAX_CAPACITY`` a message streams through in records.

    Example:
        >>> capacity_for(1 << 10) >> 10, capacity_for(16 << 20) >> 20, capacity_for(1 << 30) >> 20
        (1027, 49, 256)
    """
    return min(MAX_CAPACITY, 3 * largest_message + _SLACK)


def all_pairs(num_ranks: int, capacity: int = DEFAULT_CAPACITY) -> dict[tuple[int, int], int]:
    """A ring of ``capacity`` bytes for every ordered pair of ``num_ranks`` ranks (for callers that know no pairs).

    Example:
        >>> sorted(all_pairs(3, 1 << 12).items())[:2]
        [((0, 1), 4096), ((0, 2), 4096)]
    """
    return {(s, r): capacity for s in range(num_ranks) for r in range(num_ranks) if s != r}


def ring_bytes(rings: Rings) -> int:
    """Bytes of shared memory ``rings`` take (each ring's control block and data, whole records).

    Example:
        >>> ring_bytes({(0, 1): 1 << 20, (1, 0): 1 << 20}) == 2 * ((1 << 20) + 128)
        True
    """
    return sum(_CTRL + _whole(capacity) for capacity in rings.values())


def _whole(capacity: int) -> int:
    return -(-capacity // _ALIGN) * _ALIGN  # whole 64-byte records, every one aligned


def unavailable(rings: Rings) -> str | None:
    """Why ``rings`` cannot be used on this host, or None if they can.

    Checks the CPU architecture (the ring's ordering argument, module
    docstring), that ``/dev/shm`` has room for every ring twice over (a ring
    beyond the room would fault, SIGBUS, at its first message, not at
    allocation) and that the address-space limit (``ulimit -v``) leaves room
    to map them in the launcher.

    Example:
        >>> unavailable(all_pairs(2, capacity=1 << 60)) is not None   # no host has 4 x 2^60 bytes of /dev/shm
        True
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "this CPU is not x86-64"
    if torch.cuda.is_available():
        return "CUDA ranks use NCCL"
    need = ring_bytes(rings)
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return "no /dev/shm"
    free = stat.f_bavail * stat.f_frsize
    if free < 2 * need:
        return f"/dev/shm has {free >> 20} MiB free, {2 * need >> 20} MiB wanted"
    room = _address_space_left()
    if room is not None and room < 2 * need:
        return f"the address-space limit (ulimit -v) leaves {room >> 20} MiB, {2 * need >> 20} MiB wanted for the rings"
    return None


def _address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (``RLIMIT_AS``); None: no limit."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):  # pragma: no cover - no /proc
        return None
    return max(0, limit - size)


def make_channels(ctx: Any, rings: Rings) -> dict[tuple[int, int], Channel]:
    """Each ring's channel, ``(sender, receiver) -> Channel`` (called by the launcher before spawning).

    Raises:
        RingsFailed: a ring could not be made (out of memory or address space, too many open files); the
            rings made so far are freed and no segment of this process is left in ``/dev/shm``.

    Example:
        >>> import multiprocessing
        >>> sorted(make_channels(multiprocessing.get_context("spawn"), all_pairs(2, 1 << 12)))
        [(0, 1), (1, 0)]
    """
    pattern = f"/dev/shm/torch_{os.getpid()}_*"  # torch's segments, unlinked once mapped: left where mapping failed
    before = set(glob.glob(pattern))
    channels: dict[tuple[int, int], Channel] = {}
    try:
        for pair, capacity in sorted(rings.items()):
            channels[pair] = Channel(ctx, capacity)
    except (RuntimeError, OSError, MemoryError) as exc:
        channels.clear()
        for leftover in set(glob.glob(pattern)) - before:
            try:
                os.unlink(leftover)
            except OSError:  # pragma: no cover - gone already
                pass
        raise RingsFailed(_failure(rings, exc)) from None
    return channels


def _failure(rings: Rings, exc: BaseException) -> str:
    """One line: what the rings need, what failed, the fix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    short = "Cannot allocate memory" in text or isinstance(exc, MemoryError)
    why = "out of memory or address space (ulimit -v?)" if short else text[:160]
    largest = max(rings.values()) if rings else 0
    return (
        f"cannot make the shared-memory message rings: {len(rings)} ring{'s' * (len(rings) != 1)} need"
        f"{'' if len(rings) != 1 else 's'} {ring_bytes(rings) / 2**20:.1f} MiB "
        f"(the largest {largest / 2**20:.0f} MiB): {why}; use --transport gloo, fewer ranks or a smaller --batch"
    )


def _record(pos: int, nbytes: int, capacity: int) -> tuple[int, int]:
    """(padding skipped before the record, record length) for a record of ``nbytes`` written at byte ``pos``."""
    length = _HEADER + -(-nbytes // _ALIGN) * _ALIGN
    offset = pos % capacity
    return (capacity - offset if offset + length > capacity else 0), length


def _chunk(capacity: int) -> int:
    """Payload bytes of a full record: a quarter of the ring, so a message of any size streams through it."""
    return max(_ALIGN, capacity // 4 // _ALIGN * _ALIGN)


def _nbytes(tensor: torch.Tensor, nbytes: int | None) -> int:
    """Bytes of ``tensor``, checked to be contiguous on the CPU unless the caller gives ``nbytes`` (and vouches)."""
    if nbytes is not None:  # P2P: contiguous by construction, size known (no tensor call on the hot path)
        return nbytes
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(
            f"shm carries contiguous CPU tensors, got a {tensor.device} tensor of strides {tensor.stride()}"
        )
    return int(tensor.nbytes)


class SendWork:
    """A posted send: complete once its record is in the ring (the tensor may then change)."""

    def __init__(self, transport: ShmTransport, peer: int) -> None:
        self.transport, self.peer, self.done = transport, peer, False

    def is_completed(self) -> bool:
        self.transport.flush(self.peer)
        return self.done

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.transport.wait_until(lambda: self.is_completed(), None, timeout)
        return True


class _Sent:
    """The work of a send whose record went into the ring at once (most sends): nothing to wait for."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True


SENT = _Sent()


class RecvWork:
    """A posted receive into ``buffer``: complete once its record was copied out of the ring."""

    def __init__(self, transport: ShmTransport, peer: int, buffer: torch.Tensor, tag: int, nbytes: int) -> None:
        self.transport, self.peer, self.buffer, self.tag, self.done = transport, peer, buffer, tag, False
        self.address, self.nbytes = buffer.data_ptr(), nbytes
        self.offset = 0  # bytes copied out so far

    def is_completed(self) -> bool:
        self.transport.progress(self.peer)
        return self.done

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        t = self.transport
        if not self.done:
            t.progress(self.peer)  # the record is often there already: no waiting machinery
        if not self.done:
            t.wait_until(lambda: self.is_completed(), t.incoming[self.peer], timeout)
        return True


class ShmTransport:
    """This rank's ends of every channel: ``isend``/``irecv`` returning work objects like gloo's.

    Args:
        rank: this rank.
        channels: every ordered pair's channel (``make_channels``).
    """

    def __init__(self, rank: int, channels: dict[tuple[int, int], Channel]) -> None:
        self.rank = rank
        self.outgoing = {r: c for (s, r), c in channels.items() if s == rank}
        self.incoming = {s: c for (s, r), c in channels.items() if r == rank}
        # Per peer, messages not yet wholly in its ring:
        # [payload address, bytes, tag, work, bytes written so far, the tensor (kept alive until written)].
        self._queued: dict[int, deque[list[Any]]] = {p: deque() for p in self.outgoing}
        self._posted: dict[int, deque[RecvWork]] = {p: deque() for p in self.incoming}
        self._tokens = {p: 0 for p in self.incoming}  # semaphore acquires made ahead of their record

    # ---- sends ----------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int, tag: int, nbytes: int | None = None) -> SendWork | _Sent:
        """Copy contiguous CPU ``tensor`` into the ring to ``peer`` now, as far as it fits; the rest is queued.

        ``nbytes``: the tensor's size in bytes when the caller knows it (saves
        asking the tensor). A message larger than a quarter of the ring goes as
        several records (``_chunk``), written as the receiver frees room.
        Returns ``SENT`` when the whole message is in the ring already.
        """
        work = SendWork(self, peer)
        queued = self._queued[peer]
        queued.append([tensor.data_ptr(), _nbytes(tensor, nbytes), tag, work, 0, tensor])
        self.flush(peer)
        return work if queued else SENT

    def flush(self, peer: int) -> None:
        """Write the queued records to ``peer`` that fit in its ring, in order."""
        queued, channel = self._queued[peer], self.outgoing[peer]
        chunk, words, ctrl, capacity = channel.chunk, channel.words, channel.ctrl, channel.capacity
        while queued:
            message = queued[0]
            address, nbytes, tag, work, offset, _ = message
            while True:
                n = min(chunk, nbytes - offset)
                written, read = int(ctrl[0]), int(ctrl[8])
                pad, length = _record(written, n, capacity)
                if written + pad + length - read > capacity:
                    message[4] = offset
                    return
                start = (written + pad) % capacity
                words[start // 8], words[start // 8 + 1] = tag, n
                if n:  # a plain memmove: no tensor op (each is slow right after a compute action)
                    _memmove(channel.address + start + _HEADER, address + offset, n)
                ctrl[0] = written + pad + length
                channel.ready.release()
                offset += n
                if offset >= nbytes:
                    break
            work.done = True
            queued.popleft()

    def pending_sends(self) -> bool:
        return any(self._queued.values())

    # ---- receives -------------------------------------------------------
    def irecv(self, buffer: torch.Tensor, peer: int, tag: int, nbytes: int | None = None) -> RecvWork:
        """Post a receive from ``peer`` into contiguous CPU ``buffer`` (of ``nbytes`` bytes, if known).

        Records are matched to posted receives in order.
        """
        work = RecvWork(self, peer, buffer, tag, _nbytes(buffer, nbytes))
        self._posted[peer].append(work)
        self.progress(peer)
        return work

    def progress(self, peer: int) -> None:
        """Copy out every record from ``peer`` that has arrived for a posted receive, in order."""
        posted, channel = self._posted[peer], self.incoming[peer]
        chunk, words, ctrl, capacity = channel.chunk, channel.words, channel.ctrl, channel.capacity
        while posted:
            work = posted[0]
            written, read = int(ctrl[0]), int(ctrl[8])
            if written == read:
                return
            # The semaphore first: its release follows the sender's payload write on any CPU.
            if self._tokens[peer]:
                self._tokens[peer] -= 1
            elif not channel.ready.acquire(timeout=5.0):  # pragma: no cover - released right after writing
                raise RuntimeError(f"rank {self.rank}: shm semaphore from rank {peer} lost a release")
            n = min(chunk, work.nbytes - work.offset)
            pad, length = _record(read, n, capacity)
            start = (read + pad) % capacity
            tag, size = words[start // 8], words[start // 8 + 1]
            if (tag, size) != (work.tag, n):  # pragma: no cover - an ordering bug
                raise RuntimeError(
                    f"rank {self.rank}: shm record from rank {peer} has tag {tag} "
                    f"({size} bytes), expected tag {work.tag} ({n} bytes)"
                )
            if n:
                _memmove(work.address + work.offset, channel.address + start + _HEADER, n)
            ctrl[8] = read + pad + length
            work.offset += n
            if work.offset >= work.nbytes:
                work.done = True
                posted.popleft()

    # ---- waiting --------------------------------------------------------
    def wait_until(self, done: Any, channel: Channel | None, timeout: datetime.timedelta | None) -> None:
        """Block (on ``channel``'s semaphore when given) until ``done()``; flush own sends meanwhile.

        No busy-polling first: it halved the hand-over of a message to a waiting
        rank but did not shorten steps (benchmarks/runtime/README.md), and where
        ranks outnumber cores a polling rank takes a computing rank's core.
        """
        limit = timeout.total_seconds() if timeout is not None else 1800.0
        start = time.monotonic()
        while not done():
            for peer in self._queued:
                self.flush(peer)
            now = time.monotonic()
            if now - start > limit:
                raise TimeoutError(f"rank {self.rank}: no shm message for {limit:.0f} s (a peer failed or hung)")
            slice_s = _SLICE_S if (self.pending_sends() or channel is None) else min(1.0, limit)
            if channel is None:
                time.sleep(slice_s / 10)
            elif channel.ready.acquire(timeout=slice_s):
                peer = next(p for p, c in self.incoming.items() if c is channel)
                self._tokens[peer] += 1


def connect(rank: int, channels: dict[tuple[int, int], Channel]) -> ShmTransport:
    """This rank's shared-memory transport over ``channels`` (a spawned rank, before its work starts), every
    ring mapped and its pages touched; it goes in the rank's ``RankContext.transport``, which ``P2P`` sends through.

    Raises:
        RingsFailed: a ring could not be mapped here (out of memory or address space).
    """
    try:
        for channel in channels.values():
            channel.attach()
    except (RuntimeError, OSError) as exc:
        raise RingsFailed(_failure(channels_rings(channels), exc)) from None
    transport = ShmTransport(rank, channels)
    for channel in (*transport.outgoing.values(), *transport.incoming.values()):
        channel.map_pages()
    return transport


def channels_rings(channels: dict[tuple[int, int], Channel]) -> dict[tuple[int, int], int]:
    """The rings ``channels`` are: ``(sender, receiver) -> bytes``."""
    return {pair: channel.capacity for pair, channel in channels.items()}
