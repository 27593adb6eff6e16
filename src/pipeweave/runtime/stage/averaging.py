"""AvgPipe's averaging between pipelines on ranks of their own (``avgpipe(..., own_ranks=True)``).

Each replica of a part lives on its own rank. When a stage makes update round n
(counted over the run) and n is a multiple of ``--avg-every``, it sends the
weights it holds then, x_n, to the part's other replicas: an all-reduce over
their ranks (``CollectiveExchange``), or, in the one-process reference, a table
the replicas of every rank share (``LocalExchange``). It does not wait: the
next mini-batch's forwards and backwards run on x_n while the exchange is in
flight (the paper's advancing forward pass), and just before its next update,
or when the stream drains, the stage takes the replicas' mean and applies the
elastic pull ``x <- x + alpha (mean - x_n)`` (``weights.avgpipe``). Between two
updates a replica's weights do not change, so x is still x_n then: the pull is
``elastic_average`` of the replicas at round n, applied one mini-batch later.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipeweave.weights.avgpipe import default_alpha


class Pending(Protocol):
    """An exchange in flight: ``mean()`` waits for it and returns the replicas' mean, per tensor."""

    def mean(self) -> list[torch.Tensor]: ...


class Exchange(Protocol):
    """Starts the exchange of one replica's weights at one round."""

    def start(self, part: int, round_: int, tensors: Sequence[torch.Tensor]) -> Pending: ...


class _Collective:
    def __init__(self, work: Any, flat: torch.Tensor, shapes: list[torch.Size], count: int) -> None:
        self.work, self.flat, self.shapes, self.count = work, flat, shapes, count

    def mean(self) -> list[torch.Tensor]:
        self.work.wait()
        mean = self.flat / self.count
        return [m.view(shape) for m, shape in zip(mean.split([s.numel() for s in self.shapes]), self.shapes)]


class CollectiveExchange:
    """An asynchronous all-reduce of the replicas' weights over the group of their ranks (``Mesh.replica_groups``).

    Args:
        groups: per part, the process group of the ranks holding its replicas.
        replicas: P, the number of replicas of each part.
    """

    def __init__(self, groups: dict[int, Any], replicas: int) -> None:
        self.groups, self.replicas = groups, replicas

    def start(self, part: int, round_: int, tensors: Sequence[torch.Tensor]) -> Pending:
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        work = dist.all_reduce(flat, group=self.groups[part], async_op=True)
        return _Collective(work, flat, [t.shape for t in tensors], self.replicas)


class _Gathered:
    def __init__(self, table: dict[tuple[int, int], list[list[torch.Tensor]]], key: tuple[int, int], count: int):
        self.table, self.key, self.count = table, key, count

    def mean(self) -> list[torch.Tensor]:
        sent = self.table[self.key]
        if len(sent) < self.count:
            raise RuntimeError(f"averaging round {self.key[1]} of part {self.key[0]}: {len(sent)} of {self.count}")
        total = [torch.stack(ts).sum(dim=0) for ts in zip(*sent)]
        return [t / self.count for t in total]


class LocalExchange:
    """The replicas of every rank in one process (the reference): a shared table of what each sent per round.

    Args:
        replicas: P, the number of replicas of each part.
    """

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.table: dict[tuple[int, int], list[list[torch.Tensor]]] = {}

    def start(self, part: int, round_: int, tensors: Sequence[torch.Tensor]) -> Pending:
        self.table.setdefault((part, round_), []).append([t.detach().clone() for t in tensors])
        return _Gathered(self.table, (part, round_), self.replicas)

    def complete(self, part: int, round_: int) -> bool:
        """True once every replica of ``part`` has sent round ``round_``."""
        return len(self.table.get((part, round_), ())) >= self.replicas


class DelayedAveraging:
    """One rank's side of the averaging: starts an exchange after a due update, applies it before the next.

    Args:
        exchange: how the replicas' weights meet.
        part_of: per stage of this rank, its part.
        replicas: P.
        period: ``--avg-every``: rounds between averagings.
        alpha: the moving rate (None: 0.9 / P, EASGD's beta = 0.9).
    """

    def __init__(
        self, exchange: Exchange, part_of: dict[int, int], replicas: int, period: int, alpha: float | None
    ) -> None:
        self.exchange, self.part_of, self.period = exchange, part_of, period
        self.alpha = default_alpha(replicas) if alpha is None else alpha
        self.pending: dict[int, tuple[int, int, Pending]] = {}  # stage -> (round, start ns, exchange in flight)
        self.events: list[tuple[int, int, int, int]] = []
        """Per exchange: (stage, round, start, end) in perf_counter ns, from its start to the mean in hand."""

    def after_update(self, stage: int, round_: int, params: Sequence[torch.Tensor]) -> None:
        """Round ``round_`` (counted over the run) is made: start its exchange if it is due."""
        if round_ % self.period == 0:
            started = time.perf_counter_ns()
            self.pending[stage] = (round_, started, self.exchange.start(self.part_of[stage], round_, params))

    def waiting_on(self, stage: int) -> tuple[int, int] | None:
        """(part, round) whose exchange the stage's next update needs, or None."""
        if stage not in self.pending:
            return None
        return self.part_of[stage], self.pending[stage][0]

    def apply(self, stage: int, params: Sequence[torch.Tensor]) -> None:
        """Before the stage's next update (or at the drain): pull its weights toward the round's mean."""
        if stage not in self.pending:
            return
        round_, started, pending = self.pending.pop(stage)
        means = pending.mean()
        self.events.append((stage, round_, started, time.perf_counter_ns()))
        with torch.no_grad():
            for p, mean in zip(params, means):
                p.add_(mean.to(p.dtype) - p, alpha=self.alpha)

    def drain(self, params_of: dict[int, Sequence[torch.Tensor]]) -> None:
        """The stream is over: apply what is still in flight."""
        for stage in sorted(self.pending):
            self.apply(stage, params_of[stage])
