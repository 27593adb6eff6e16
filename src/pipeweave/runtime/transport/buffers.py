"""Where point-to-point messages live and run: a pool of receive buffers and, on CUDA, a communication stream.

``RecvPool``: every message of a fixed-shape activation stream (``(sender
stage, kind)``, ``transport.order``) is received into a buffer of its
stream's pool. The pool learns a stream's dtype and shapes from its first
step's metadata and makes a buffer only when every buffer of that shape is
still held by a consumer: a buffer comes back to the pool when the last
tensor on its storage dies -- when the stage lets go of the received
activation (after its ``B``, or ``W`` where the input is needed there) or of
the received gradient (after its ``B``), i.e. as 1F1B releases activations.
The pool therefore holds, per stream, at most as many buffers as that stream
ever had alive at once in one step, the same from the second step on
(``count`` and ``nbytes`` measure it). Whether a storage is still held is its
use count (``torch._C._storage_Use_Count``; the pool's own references are
counted once, when the buffer is made). Buffers have exactly the message's
dtype and shape, so memory meters count them as they counted the fresh
tensors before.

``CommStream``: on CUDA every group of messages (``p2p.post_group``) is posted
from a dedicated stream, which first waits for the compute stream's work so
far (a sent tensor is complete, a reused receive buffer no longer read); the
compute stream waits on an event of that stream only where an action takes a
received tensor (``consume``). A sent tensor is kept alive until its send has
completed and is ``record_stream``'ed on the communication stream when its
wait was issued there (``retire``), so the caching allocator cannot hand its
memory to a kernel before the send has read it. On the CPU every method is
the plain call: gloo runs the same groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _use_count(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s storage (tensors viewing it, storage objects), counted the same way each time."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


class RecvPool:
    """Receive buffers per message stream, reused once nothing holds them (module docstring).

    Example:
        >>> pool = RecvPool(torch.device("cpu"))
        >>> a = pool.take((0, 0), torch.float32, (2, 3)); b = pool.take((0, 0), torch.float32, (2, 3))
        >>> pool.count
        2
        >>> del a; c = pool.take((0, 0), torch.float32, (2, 3)); pool.count, pool.nbytes
        (2, 48)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Per (stream, dtype, shape): every buffer made, with its storage's use count when only the pool held it.
        self._buffers: dict[tuple[Any, torch.dtype, tuple[int, ...]], list[tuple[torch.Tensor, int]]] = {}

    def take(self, stream: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` on a buffer of ``stream``'s that nothing else holds (made if none)."""
        buffers = self._buffers.setdefault((stream, dtype, shape), [])
        for buffer, idle in buffers:
            if _use_count(buffer) == idle:
                return buffer.detach()  # an alias: the buffer is held again until it and its views die
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        buffers.append((buffer, _use_count(buffer)))
        return buffer.detach()

    @property
    def count(self) -> int:
        """Buffers the pool holds, over every stream."""
        return sum(len(buffers) for buffers in self._buffers.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the pool holds."""
        return sum(b.numel() * b.element_size() for buffers in self._buffers.values() for b, _ in buffers)

    def in_use(self) -> int:
        """Buffers some consumer still holds."""
        return sum(_use_count(b) != idle for buffers in self._buffers.values() for b, idle in buffers)


class CommStream:
    """The stream point-to-point groups run on (CUDA), or nothing (CPU: every method is the plain call).

    Example (CPU):
        >>> CommStream(torch.device("cpu")).post(lambda: 7)
        7
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def post(self, launch: Callable[[], T]) -> T:
        """Run ``launch`` (which posts a group) on the communication stream, after the compute stream's work so far."""
        if self.stream is None:
            return launch()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            return launch()

    def consume(self, work: Any, timeout: Any = None) -> None:
        """Wait for ``work`` (a receive) where its tensor is taken: on CUDA the compute stream waits on an event."""
        if self.stream is None:
            work.wait(timeout)
            return
        with torch.cuda.stream(self.stream):
            work.wait(timeout)  # NCCL: the communication stream waits for the group's kernel, the host does not
        event = torch.cuda.Event()
        event.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(event)

    def retire(self, works: Iterable[Any], tensors: Iterable[torch.Tensor], timeout: Any = None) -> None:
        """Wait for sends' ``works`` on the communication stream and mark their ``tensors`` used there until then."""
        if self.stream is None:
            for work in works:
                work.wait(timeout)
            return
        with torch.cuda.stream(self.stream):
            for work in works:
                work.wait(timeout)
        for tensor in tensors:
            tensor.record_stream(self.stream)  # freed only once the stream has passed the waits above
