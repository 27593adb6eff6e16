"""``--transport host``: point-to-point messages of ranks that share one GPU, staged through host buffers.

NCCL refuses two ranks on one device, and gloo carries no CUDA tensor from
rank to rank. This transport lets a machine with one GPU run a 2-4 stage
pipeline on CUDA anyway: every message is copied into a (pinned) host
buffer, sent over gloo, received into a host buffer on the other side and
copied onto the receiver's device. It is not a production mode -- each
send waits for the kernels that made its tensor, and every byte crosses
the host twice -- but the harness that runs every CUDA path (exactness,
streams, offload's pinned store, memory accounting, event timing) where a
single GPU is all there is (``benchmarks/gpu``). The launcher forms a gloo
group for it (collectives then run on gloo too, on CUDA tensors where gloo
has them); under torchrun, whose group is NCCL's, it is refused in one line.

A message is its tensor's bytes, so dtypes gloo lacks travel too. Staging
buffers are kept per size and reused once their message is through: a
send's when gloo completed it, a receive's once its copy to the device is
done (a CUDA event; at once on the CPU). On the CPU the same path runs
with plain host buffers: what the tests exercise.

Example:
    transport = HostTransport(rank, world)      # in RankContext.transport: P2P sends through it
    work = transport.isend(tensor, peer, tag)   # tensor on any device
    transport.irecv(buffer, peer, tag).wait()   # buffer filled on its device
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat ``uint8`` view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("a host-staged message must be contiguous; P2P sends contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


class StagingPool:
    """Host buffers of each size, reused once what used them is done.

    Args:
        pin: page-locked buffers (CUDA: asynchronous copies at full bandwidth); False on the CPU.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.busy: list[tuple[torch.Tensor, Callable[[], bool]]] = []
        self.made = 0
        """Buffers allocated so far: they stop growing once a step's messages found theirs (tested)."""

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of ``nbytes`` bytes, or a new one."""
        self.reclaim()
        free = self.free.get(nbytes)
        if free:
            return free.pop()
        self.made += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, buffer: torch.Tensor, done: Callable[[], bool]) -> None:
        """``buffer`` is free again once ``done()``."""
        self.busy.append((buffer, done))

    def reclaim(self) -> None:
        """Free every busy buffer whose use is over."""
        still = []
        for buffer, done in self.busy:
            if done():
                self.free.setdefault(buffer.numel(), []).append(buffer)
            else:
                still.append((buffer, done))
        self.busy = still


class HostSend:
    """A posted send: its bytes are on the host already; complete when gloo has sent them."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.work.wait(timeout) if timeout is not None else self.work.wait()
        return True


class HostRecv:
    """A posted receive into a host buffer; ``wait`` copies it onto ``buffer``'s device, on the current stream."""

    def __init__(self, work: Any, staging: torch.Tensor, buffer: torch.Tensor, pool: StagingPool) -> None:
        self.work, self.staging, self.buffer, self.pool = work, staging, buffer, pool
        self.copied = False

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.copied:
            return True
        self.work.wait(timeout) if timeout is not None else self.work.wait()
        target = as_bytes(self.buffer)
        if self.buffer.device.type == "cuda":
            target.copy_(self.staging, non_blocking=True)  # ordered before the kernels that read the buffer
            copied = torch.cuda.Event()
            copied.record()
            self.pool.release(self.staging, copied.query)
        else:
            target.copy_(self.staging)
            self.pool.release(self.staging, lambda: True)
        self.copied = True
        return True


class HostTransport:
    """This rank's host-staged messages to and from every other process (``RankContext.transport``).

    Args:
        rank: this process.
        world: the processes of the run.
        pin: pinned staging buffers (default: where CUDA is available).
    """

    def __init__(self, rank: int, world: int, pin: bool | None = None) -> None:
        self.rank = rank
        peers = frozenset(p for p in range(world) if p != rank)
        self.outgoing, self.incoming = peers, peers  # P2P sends to a peer in these through this transport
        self.pool = StagingPool(torch.cuda.is_available() if pin is None else pin)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, nbytes: int | None = None) -> HostSend:
        """Copy ``tensor`` into a host buffer (waiting for the kernels that make it) and post its send to
        ``peer`` over gloo."""
        data = as_bytes(tensor)
        staging = self.pool.take(data.numel())
        staging.copy_(data)  # device to host: returns once the bytes are on the host
        work = HostSend(dist.isend(staging, peer, tag=tag))
        self.pool.release(staging, work.is_completed)
        return work

    def irecv(self, buffer: torch.Tensor, peer: int, tag: int, nbytes: int | None = None) -> HostRecv:
        """Post a receive from ``peer`` into a host buffer; its ``wait`` fills ``buffer`` on its device."""
        staging = self.pool.take(buffer.nbytes)
        return HostRecv(dist.irecv(staging, peer, tag=tag), staging, buffer, self.pool)
