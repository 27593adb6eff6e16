"""A microbatch's saved activations packed into one flat buffer, moved away and rebuilt (``schedule.levers``).

After F, everything a stage keeps of a microbatch for its backward -- the
tensors autograd saved (caught by ``saved_tensors_hooks``, ``stage.memory``)
and the stage's kept input, output and target -- is made of a few storages.
``pack`` copies each distinct storage (parameters excluded) into one flat
byte buffer and points every tensor at nothing; ``unpack`` gives each storage
back as a fresh tensor from the buffer (wherever the buffer went) and
re-points every tensor, with its own dtype, size, stride and offset, at it:
the same bytes, so training is bitwise unchanged.

Compression (``stash_hooks``) acts earlier, in the saved-tensor hook itself:
every float32 tensor autograd saves (but the stage's inputs, kept whole
anyway, and parameters) is stashed as a bfloat16 copy, which the backward gets
back in float32; the original is freed as soon as the forward lets go of it,
so no full-size copy outlives F. Lossy: 8 bits of mantissa.

Where the buffer goes is a store's business:

- ``FileStore`` (CPU): a memory-mapped file per microbatch in a directory on
  local disk, as ZeRO-Infinity offloads to NVMe; written at OFFLOAD, read and
  deleted at RELOAD. Synchronous: the copies take the rank's own time.
- ``PinnedStore`` (CUDA): asynchronous copies on a side stream into pinned host
  buffers; a RELOAD is started one action ahead (``prefetch``) and the backward's
  stream waits for it. Written for CUDA, untested here (no GPU on this machine).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeweave.models.boundary import tensors
from pipeweave.runtime.stage.memory import ActivationMeter, _Held
from pipeweave.runtime.stage.memory import unpack as unpack_held


@dataclass
class _Segment:
    key: int  # the original storage's address
    offset: int  # in the buffer
    size: int  # bytes in the buffer


class _View(tuple):  # type: ignore[type-arg]
    """A tensor's view of its storage, without the storage: (key, dtype, offset, size, stride)."""


@dataclass
class Packed:
    """A microbatch's storages in one buffer, and the tensors that view them."""

    buffer: torch.Tensor | Any  # uint8; a store's handle once moved away
    segments: list[_Segment]
    views: list[tuple[Any, str, _View]] = field(default_factory=list)  # (owner, attribute, what it viewed)

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.segments)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def pack(holders: list[tuple[Any, str]], exclude: set[int]) -> Packed:
    """Copy the storages behind ``getattr(owner, attribute)`` of every holder into one buffer, and
    point each holder at an empty tensor of its dtype. Storages in ``exclude`` (parameters) stay.

    Example:
        >>> class Box: pass
        >>> b = Box(); b.t = torch.arange(4.0)
        >>> p = pack([(b, "t")], exclude=set()); b.t.numel(), p.nbytes
        (0, 16)
        >>> unpack(p, p.buffer); b.t
        tensor([0., 1., 2., 3.])
    """
    storages: dict[int, torch.UntypedStorage] = {}
    views = []
    for owner, attribute in holders:
        t = getattr(owner, attribute)
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in exclude:
            continue
        storages[key] = storage
        views.append((owner, attribute, _View((key, t.dtype, t.storage_offset(), t.size(), t.stride()))))
    segments, pieces, offset = [], [], 0
    for key, storage in storages.items():
        piece = _bytes_of(storage)
        segments.append(_Segment(key, offset, piece.numel()))
        pieces.append(piece)
        offset += piece.numel()
    buffer = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    device = buffer.device
    for owner, attribute, view in views:
        _point(owner, attribute, torch.empty(0, dtype=view[1], device=device))
    return Packed(buffer, segments, views)


def unpack(packed: Packed, buffer: torch.Tensor) -> None:
    """Rebuild every storage of ``packed`` from ``buffer`` (its bytes, wherever they are now) and point
    each holder back at its view of it."""
    rebuilt: dict[int, torch.UntypedStorage] = {}
    for s in packed.segments:
        rebuilt[s.key] = buffer[s.offset : s.offset + s.size].clone().untyped_storage()
    for owner, attribute, (key, dtype, offset, size, stride) in packed.views:
        _point(
            owner, attribute, torch.empty(0, dtype=dtype, device=buffer.device).set_(rebuilt[key], offset, size, stride)
        )
    packed.views = []


def _point(owner: Any, attribute: str, tensor: torch.Tensor) -> None:
    """Set a holder: a tensor's ``.data`` (keeps its autograd identity), else the attribute itself."""
    if attribute == "data":
        owner.data = tensor
    else:
        setattr(owner, attribute, tensor)


class _Compressed(_Held):
    """A saved tensor stashed in bfloat16, given back in float32 to the backward."""

    __slots__ = ()


def _unpack(held: _Held) -> torch.Tensor:
    return held.tensor.to(torch.float32) if isinstance(held, _Compressed) else unpack_held(held)


def stash_hooks(
    meter: ActivationMeter, saved: list[Any] | None, *, counted: bool, compress_except: list[torch.Tensor] | None = None
) -> Any:
    """Saved-tensor hooks of a forward: each saved tensor counted by ``meter`` (if ``counted``) and kept in
    ``saved`` too (if given, for ``stash_away``); with ``compress_except`` (the stage's inputs, which it
    keeps whole anyway), every other float32 tensor (parameters aside) stashed in bfloat16 (lossy)."""
    skip = None if compress_except is None else {t.untyped_storage().data_ptr() for t in compress_except}

    def keep(t: torch.Tensor) -> _Held:
        key = t.untyped_storage().data_ptr()
        if skip is not None and t.dtype == torch.float32 and key not in skip and key not in meter.exclude:
            small = t.to(torch.bfloat16)
            held: _Held = _Compressed(small, meter, meter.hold(small) if counted else None)
        else:
            held = meter.pack(t) if counted else _Held(t, meter, None)
        if saved is not None:
            saved.append(held)
        return held

    return torch.autograd.graph.saved_tensors_hooks(keep, _unpack)


def stash_away(worker: Any, mb: int) -> Packed:
    """Microbatch ``mb``'s saved activations on ``worker`` (a ``StageWorker``, which imports this module) in one buffer (``pack``), no longer held there.

    Compressed tensors (``stash_hooks``) are moved as they are.
    """
    record = worker._saved[mb]
    if record.held is None:
        raise RuntimeError(
            f"stage {worker.layer_indices} did not keep microbatch {mb}'s saved tensors; set stashing before its F"
        )
    holders: list[tuple[Any, str]] = [(h, "tensor") for h in record.held]
    holders += [(t, "data") for b in (record.input, record.output, record.target) if b is not None for t in tensors(b)]
    packed = pack(holders, worker.meter.exclude)
    for h in record.held:
        if h.key is not None:
            worker.meter.release(h.key)
            h.key = None
    worker._release(record.keys)
    record.keys = []
    return packed


def stash_back(worker: Any, mb: int, packed: Packed, buffer: torch.Tensor) -> None:
    """Undo ``stash_away``: rebuild microbatch ``mb``'s saved activations on ``worker`` from ``buffer``."""
    unpack(packed, buffer)
    record = worker._saved[mb]
    for h in record.held or ():
        h.key = worker._hold(h.tensor)
    record.keys = [worker._hold(t) for b in (record.input, record.output) if b is not None for t in tensors(b)]


class FileStore:
    """Buffers in memory-mapped files of a private directory on local disk (CPU offload)."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = tempfile.mkdtemp(prefix="pipeweave-offload-", dir=directory)
        self._files: dict[Any, tuple[str, int]] = {}

    def put(self, key: Any, buffer: torch.Tensor) -> None:
        path = os.path.join(self.directory, "-".join(map(str, key)))
        n = buffer.numel()
        if n:
            mapped = torch.UntypedStorage.from_file(path, shared=True, nbytes=n)
            _bytes_of(mapped).copy_(buffer)
            del mapped  # unmapped: the pages go to the file
        self._files[key] = (path, n)

    def prefetch(self, key: Any) -> None:
        """Nothing to start ahead: a file is read when taken."""

    def take(self, key: Any) -> torch.Tensor:
        path, n = self._files.pop(key)
        if not n:
            return torch.empty(0, dtype=torch.uint8)
        mapped = _bytes_of(torch.UntypedStorage.from_file(path, shared=False, nbytes=n))
        os.unlink(path)  # the mapping keeps the pages until unpack has copied them out
        return mapped

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class PinnedStore:  # pragma: no cover - needs CUDA
    """Buffers in pinned host memory, copied on a side stream (CUDA offload), reloads started ahead."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._host: dict[Any, tuple[torch.Tensor, Any]] = {}
        self._back: dict[Any, tuple[torch.Tensor, Any]] = {}

    def put(self, key: Any, buffer: torch.Tensor) -> None:
        host = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the buffer is written
        with torch.cuda.stream(self.stream):
            host.copy_(buffer, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        buffer.record_stream(self.stream)  # not reused by the allocator before the copy ends
        self._host[key] = (host, done)

    def prefetch(self, key: Any) -> None:
        if key in self._back or key not in self._host:
            return
        host, written = self._host.pop(key)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(written)
            back = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            back.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._back[key] = (back, done)

    def take(self, key: Any) -> torch.Tensor:
        self.prefetch(key)
        back, done = self._back.pop(key)
        torch.cuda.current_stream(self.device).wait_event(done)
        back.record_stream(torch.cuda.current_stream(self.device))
        return back

    def close(self) -> None:
        self._host.clear()
        self._back.clear()


def host_store(device: torch.device, directory: str | None = None) -> FileStore | PinnedStore:
    """The offload store for ``device``: pinned memory and a side stream on CUDA, a file elsewhere."""
    return PinnedStore(device) if device.type == "cuda" else FileStore(directory)
