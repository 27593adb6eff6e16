"""Weight stashing (PipeDream, Narayanan et al., SOSP 2019): a stage's version store.

A backward must use the weights its forward used. The store keeps, for one
stage, the live parameters (the current version, updated in place by the
optimizer) and copies of older versions while some microbatch still needs
them. Vertical sync reads, at every stage, the version stage 0 read for that
microbatch: ``VerticalSyncStash`` holds those versions from the start, as it
holds the version of an in-flight microbatch.

Call order for one stage (``runtime.stage.policy``'s)::

    w = store.weights_for_forward(j)       # F(s, j): compute with w
    w = store.weights_for_backward(j)      # B(s, j) (or I and W)
    store.release(j)                       # after the last backward of j
    store.before_update(); optimizer.step(); store.after_update()   # U(s, k)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class WeightStash:
    """Versions of one stage's parameters, kept while forwards or backwards need them.

    Args:
        params: the stage's live parameters (updated in place by its optimizer).
        max_versions: raise RuntimeError if more versions would be held (2BW: 2).

    Example:
        >>> p = [torch.zeros(2)]
        >>> store = WeightStash(p)
        >>> _ = store.weights_for_forward(0)
        >>> store.before_update(); p[0] += 1; store.after_update()
        >>> store.weights_for_backward(0)[0].tolist(), store.versions_held()
        ([0.0, 0.0], 2)
    """

    def __init__(self, params: Sequence[torch.Tensor], max_versions: int | None = None) -> None:
        self.params = list(params)
        self.max_versions = max_versions
        self.version = 0
        self._old: dict[int, list[torch.Tensor]] = {}  # version -> copies (never the current)
        self._reads: dict[int, int] = {}  # microbatch -> version it reads

    def _tensors(self, version: int) -> list[torch.Tensor]:
        if version == self.version:
            return self.params
        if version not in self._old:
            raise KeyError(f"version {version} of this stage is no longer held (current {self.version})")
        return self._old[version]

    def weights_for_forward(self, microbatch: int, version: int | None = None) -> list[torch.Tensor]:
        """The weights F(s, microbatch) computes with: current, or ``version`` (vertical sync)."""
        v = self.version if version is None else version
        tensors = self._tensors(v)
        self._reads[microbatch] = v
        return tensors

    def weights_for_backward(self, microbatch: int) -> list[torch.Tensor]:
        """The weights its forward used."""
        return self._tensors(self._reads[microbatch])

    def read_version(self, microbatch: int) -> int:
        """The version ``microbatch`` reads (for the recorded trace)."""
        return self._reads[microbatch]

    def release(self, microbatch: int) -> None:
        """``microbatch``'s backward is done: its version may go."""
        self._reads.pop(microbatch, None)
        self._collect()

    def before_update(self) -> None:
        """Copy the current version aside if a microbatch still needs it."""
        if self.version in self._reads.values():
            self._old[self.version] = [p.detach().clone() for p in self.params]
            self._check()

    def after_update(self) -> None:
        """The optimizer has made the next version in place."""
        self.version += 1
        self._collect()

    def versions_held(self) -> int:
        """Versions in memory now, the current one included."""
        return 1 + len(self._old)

    def _collect(self) -> None:
        keep = set(self._reads.values())
        for v in [v for v in self._old if v not in keep]:
            del self._old[v]

    def _check(self) -> None:
        if self.max_versions is not None and self.versions_held() > self.max_versions:
            raise RuntimeError(
                f"{self.versions_held()} weight versions held, more than {self.max_versions}; "
                "give more microbatches per mini-batch"
            )


class VerticalSyncStash(WeightStash):
    """A stash whose forwards read the version stage 0 read: pending forwards keep their version too.

    Args:
        params: the stage's live parameters.
        forward_versions: microbatch -> the version its forward will read (the one stage 0 read).

    Example:
        >>> p = [torch.zeros(1)]
        >>> s = VerticalSyncStash(p, {3: 0})       # microbatch 3's forward will read version 0
        >>> s.before_update(); p[0] += 1; s.after_update()
        >>> s.weights_for_forward(3, version=0)[0].item(), s.versions_held()
        (0.0, 2)
    """

    def __init__(self, params: Sequence[torch.Tensor], forward_versions: dict[int, int]) -> None:
        super().__init__(params)
        self._reads.update(forward_versions)  # held like an in-flight microbatch's version
