"""Activation memory of a stage, counted as autograd holds it: distinct storages saved for a backward.

A stage installs ``ActivationMeter.pack`` and ``unpack`` as saved-tensor hooks
around its forward (``torch.autograd.graph.saved_tensors_hooks``): every
tensor autograd saves is counted once per storage, parameters excluded, until
autograd frees it, so ``current`` and ``peak`` are the bytes a rank really
holds for its backwards.
"""

from __future__ import annotations

import threading

import torch


class _Held:
    """A saved tensor, counted by the meter until autograd frees it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: int | None) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter.release(self.key)


class ActivationMeter:
    """Bytes of distinct tensor storages held for backward, reference-counted."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude  # storages of parameters: weight, not activation, memory
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.current = 0
        self.peak = 0
        # On CUDA, autograd may free saved tensors (and so call release) from its device thread.
        self.lock = threading.Lock()

    def key_of(self, storage: torch.UntypedStorage) -> int:
        """What tells storages apart: their address (0: none, not counted)."""
        return storage.data_ptr()

    def hold(self, t: torch.Tensor) -> int | None:
        storage = t.untyped_storage()
        key = self.key_of(storage)
        if key == 0 or key in self.exclude:
            return None
        with self.lock:
            entry = self.live.get(key)
            if entry is None:
                self.live[key] = [storage.nbytes(), 1]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            else:
                entry[1] += 1
        return key

    def release(self, key: int) -> None:
        with self.lock:
            entry = self.live[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[key]
                self.current -= entry[0]

    def pack(self, t: torch.Tensor) -> _Held:
        return _Held(t, self, self.hold(t))


def own(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied if it is a view into a larger storage (a microbatch of a batch).

    The copy makes a microbatch keep only its own samples alive, and be counted as such.
    """
    return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t


def unpack(held: _Held) -> torch.Tensor:
    return held.tensor


class Metered:
    """A stage's activation accounting through its ``meter`` (``StageWorker`` is one)."""

    meter: ActivationMeter
    track_memory: bool

    def activation_bytes(self) -> int:
        """Bytes of distinct storages held now for backward (0 when no microbatch is in flight)."""
        return self.meter.current

    def peak_activation_bytes(self) -> int:
        """Highest ``activation_bytes()`` since construction or ``reset_peak()``."""
        return self.meter.peak

    def reset_peak(self) -> None:
        self.meter.peak = self.meter.current

    def _hold(self, t: torch.Tensor) -> int | None:
        return self.meter.hold(t) if self.track_memory else None

    def _release(self, keys: list[int | None]) -> None:
        for key in keys:
            if key is not None:
                self.meter.release(key)
