"""Clocks of the ranks aligned on rank 0's, so measured actions of every rank share one time base.

Every rank records each action's start and end (``perf_counter_ns``). Clocks
are aligned once at start with an NTP-style exchange with rank 0 (the round
trip with the smallest delay among a few gives the offset to within half of
it), so several nodes share rank 0's time base.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

_ROUNDS = 8
_CLOCK_TAG = 1 << 30  # far above the executor's message tags


def align_clocks(rank: int, world: int, rounds: int = _ROUNDS) -> int:
    """This rank's ``perf_counter_ns`` minus rank 0's, in ns, by ping-pong with rank 0.

    Every rank calls it; rank 0 returns 0. Rank 0 sends its time t1, the peer
    answers with its arrival time t2, rank 0 notes the answer's arrival t4:
    offset = t2 - (t1 + t4) / 2, from the round with the smallest t4 - t1.
    Subtract the offset from local times to put them on rank 0's clock.
    """
    if world == 1:
        return 0
    buf = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        for peer in range(1, world):
            best: tuple[int, int] | None = None  # (round trip, offset)
            for _ in range(rounds):
                t1 = time.perf_counter_ns()
                buf[0] = t1
                dist.send(buf, dst=peer, tag=_CLOCK_TAG)
                dist.recv(buf, src=peer, tag=_CLOCK_TAG)
                t4 = time.perf_counter_ns()
                sample = (t4 - t1, int(buf[0]) - (t1 + t4) // 2)
                best = sample if best is None or sample < best else best
            assert best is not None
            buf[0] = best[1]
            dist.send(buf, dst=peer, tag=_CLOCK_TAG)
        dist.barrier()
        return 0
    for _ in range(rounds):
        dist.recv(buf, src=0, tag=_CLOCK_TAG)
        buf[0] = time.perf_counter_ns()
        dist.send(buf, dst=0, tag=_CLOCK_TAG)
    dist.recv(buf, src=0, tag=_CLOCK_TAG)
    dist.barrier()
    return int(buf[0])
