"""A process's peak tensor memory over a stretch of work: the allocator's on CUDA, tracked tensors on the CPU.

On CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
The CPU allocator keeps no statistics, so on the CPU ``TensorBytes`` (a
``TorchDispatchMode``) sees every operator's outputs on this thread, counts
each new storage's bytes once and uncounts them when the storage dies (a
weak reference to it): the peak of the bytes of every tensor created in the
stretch and alive at once -- activations, gradients, messages, temporaries,
the optimizer's work -- not counting those alive before it (the weights).
Autograd runs a CPU backward on the thread that calls it, so backwards count
too. FSDP2 (``--zero 3``) frees a gathered layer by resizing its storage to
zero, the storage object living on, and gathers into it again by resizing
it up: while active, ``UntypedStorage.resize_`` of a counted storage
uncounts its old memory and counts its new (else every gather would be
counted again and never uncounted). That patch is the process's: one meter
at a time (``pipeweave train`` measures one step of one rank per process).
It costs a Python call per operator: ``pipeweave train`` measures the
first step only, as it counts saved activations (``TrainConfig.memory_every_step``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class TensorBytes(TorchDispatchMode):
    """Bytes of the distinct storages operators create while active: ``current`` and ``peak``."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, Any] = {}  # by address, what uncounts the storage when it dies
        self._lock = threading.Lock()  # a storage may die on another thread (a message's)
        self._resize: Any = None  # ``UntypedStorage.resize_`` while active

    def __enter__(self) -> TensorBytes:
        self._resize = resize = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            key = storage.data_ptr()
            out = resize(storage, size)
            if key in meter._live:  # its old memory is gone: uncounted now (the finalizer spent, so that a later
                meter._live[key]()  # owner of the address stays counted), and counted again at its new size
                meter._count(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        return super().__enter__()  # type: ignore[no-any-return, no-untyped-call]

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                for inner in _plain(t):
                    self._count(inner.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key == 0 or key in self._live:
            return
        with self._lock:
            self._live[key] = weakref.finalize(storage, self._free, key, size)
            self.current += size
            self.peak = max(self.peak, self.current)

    def _free(self, key: int, size: int) -> None:
        with self._lock:
            if key in self._live:
                del self._live[key]
                self.current -= size


def _plain(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors holding ``t``'s storage: itself, or a wrapper's (a ``DTensor``'s local shard: ZeRO-3's)."""
    if not is_traceable_wrapper_subclass(t):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from _plain(inner)


@contextlib.contextmanager
def peak_tensor_bytes(device: torch.device, found: list[int]) -> Iterator[None]:
    """Append to ``found`` the peak tensor bytes of the block: the allocator's on CUDA, ``TensorBytes`` on CPU.

    Example:
        >>> found: list[int] = []
        >>> with peak_tensor_bytes(torch.device("cpu"), found):
        ...     x = torch.ones(256) * 2   # two 1 KiB tensors alive at once
        >>> found
        [2048]
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield
        found.append(int(torch.cuda.max_memory_allocated(device)))
        return
    mode = TensorBytes()
    with mode:
        yield
    found.append(mode.peak)
