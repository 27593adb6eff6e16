"""BPipe's exchange between a rank and its partner D-1-r (``schedule.levers``): bytes lent and taken back.

Kim et al. 2023, "BPipe: Memory-Balanced Pipeline Parallelism for Training Large Language Models".

The owner (the rank of the pair above the pair's mean) runs EVICT and LOAD in
its row: ``lend`` sends a header (key, size) and the bytes, ``take_back``
asks for them and receives them. The partner holds them in between without
any action of its own: a service thread, started with the link, answers the
owner in the order of its requests, so the partner's row never waits for its
owner and no order of the two rows can deadlock. The pair talks over a
process group of its own (every process creates every pair's group, in one
order: ``pair_groups``), so its messages never mix with the pipeline's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_STOP, _LEND, _TAKE = 0, 1, 2


def pair_groups(num_ranks: int) -> dict[int, Any]:
    """Per rank of a pair (r, D-1-r), the pair's process group; every process must call this, in one order."""
    groups: dict[int, Any] = {}
    for r in range(num_ranks // 2):
        group = dist.new_group([r, num_ranks - 1 - r])
        groups[r] = groups[num_ranks - 1 - r] = group
    return groups


class PartnerLink:
    """One side of a pair: the owner's ``lend``/``take_back``, or the partner's service thread.

    Args:
        partner: the other rank of the pair.
        group: the pair's process group.
        owner: this rank lends (runs EVICT/LOAD); else it serves.
        held_now: the serving rank's own activation bytes now, for its peak with what it holds.
    """

    def __init__(self, partner: int, group: Any, *, owner: bool, held_now: Callable[[], int] = lambda: 0) -> None:
        self.partner, self.group, self.owner = partner, group, owner
        self.held_now = held_now
        self.share = 0.0
        """Owning: the share of each microbatch's packed bytes lent (``schedule.levers.evicted_shares``)."""
        self.lent = 0
        """Serving: bytes held for the owner now."""
        self.peak = 0
        """Serving: the highest own + lent bytes seen when something was lent."""
        self._sizes: dict[tuple[int, int], int] = {}
        self._kept: dict[tuple[int, int], torch.Tensor] = {}
        self._thread = None if owner else threading.Thread(target=self._serve, daemon=True, name="bpipe-partner")
        if self._thread is not None:
            self._thread.start()

    def lend(self, key: tuple[int, int], buffer: torch.Tensor) -> None:
        """Owner: the partner keeps ``buffer`` (uint8) under ``key`` until ``take_back``."""
        self._sizes[key] = buffer.numel()
        dist.send(torch.tensor([_LEND, key[0], key[1], buffer.numel()]), self.partner, group=self.group)
        dist.send(buffer.contiguous(), self.partner, group=self.group)

    def take_back(self, key: tuple[int, int]) -> torch.Tensor:
        """Owner: what was lent under ``key``."""
        n = self._sizes.pop(key)
        dist.send(torch.tensor([_TAKE, key[0], key[1], n]), self.partner, group=self.group)
        buffer = torch.empty(n, dtype=torch.uint8)
        dist.recv(buffer, self.partner, group=self.group)
        return buffer

    def close(self) -> None:
        """Owner: end the partner's service (the run is over). Partner: wait for that."""
        if self.owner:
            dist.send(torch.tensor([_STOP, 0, 0, 0]), self.partner, group=self.group)
        elif self._thread is not None:
            self._thread.join()

    def _serve(self) -> None:
        header = torch.empty(4, dtype=torch.int64)
        while True:
            dist.recv(header, self.partner, group=self.group)
            kind, stage, mb, n = header.tolist()
            if kind == _STOP:
                return
            if kind == _LEND:
                buffer = torch.empty(n, dtype=torch.uint8)
                dist.recv(buffer, self.partner, group=self.group)
                self._kept[(stage, mb)] = buffer
                self.lent += n
                self.peak = max(self.peak, self.held_now() + self.lent)
            else:
                buffer = self._kept.pop((stage, mb))
                dist.send(buffer, self.partner, group=self.group)
                self.lent -= n
