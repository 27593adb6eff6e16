"""Expert parallelism (Lepikhin et al. 2020, "GShard"): a mixture-of-experts layer's experts split over an ``ep``
group, each token sent by all-to-all to the rank holding its expert and its output sent back.

Each of the E ranks of an ``ep`` group (``transport.mesh``: E data-parallel
replicas of one pipeline stage) keeps 1/E of the layer's experts -- rank j
the j-th consecutive share -- and routes its own tokens. ``ExpertDispatch``
replaces the layer's local dispatch: ``dispatch`` takes the rows (token
copies, one per chosen expert) sorted by expert with the count per expert,
exchanges the counts (``transport.all_to_all.exchange_counts``), sends each
share of rows to its rank (``all_to_all``, uneven splits), and regroups what
it receives by local expert (from every source rank, in rank order);
``combine`` undoes the regrouping and sends every row back where it came
from. Both are differentiable (the backward of an all-to-all is the reverse
one), so the exchanges sit on the input gradient's path: ``I`` (or ``B``)
runs them, and zero-bubble's deferred ``W`` of the experts stays local work
on the rows this rank received, as for any deferrable layer.

A rank whose router sends no row to some expert still takes part in every
exchange (zero rows), so no rank waits on a peer; an expert that receives
no row on any rank gets a zero gradient. The experts' parameters are marked
(``is_expert``): the replicas' reduction sums them only over the ranks
holding the same share (``runtime.replicas``).

Example (on each rank of a group of 2, 4 experts, ``x`` sorted by expert)::

    dispatch = ExpertDispatch(ExpertParallel(group, rank, 2), num_experts=4)
    rows, per_expert, handle = dispatch.dispatch(x, counts)   # rows of my 2 experts, grouped by expert
    y = dispatch.combine(experts(rows, per_expert), handle)   # back in x's order
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.moe import LocalDispatch, MoE, Routing
from pipeweave.runtime.transport.all_to_all import all_to_all, exchange_counts
from pipeweave.runtime.transport.mesh import ExpertParallel

__all__ = [
    "AllToAllDispatch",
    "ExpertDispatch",
    "ExpertParallel",
    "ExpertShare",
    "ExpertTraffic",
    "is_expert",
    "mark_expert",
    "shard_experts",
    "traffic_of",
]


def mark_expert(module: nn.Module) -> None:
    """Mark ``module``'s parameters as one share of an expert-parallel layer's experts (``is_expert``)."""
    for param in module.parameters():
        param.expert_parallel = True  # type: ignore[attr-defined]


def is_expert(param: torch.Tensor) -> bool:
    """True for a parameter ``mark_expert`` marked: held by one ``ep`` rank, not by every replica."""
    return getattr(param, "expert_parallel", False)


@dataclass
class ExpertTraffic:
    """What one layer's dispatches on this rank moved since the last ``take``: rows per local expert and the
    seconds spent inside its all-to-alls."""

    first: int = 0
    """The layer's index of this rank's first expert."""
    rows: torch.Tensor | None = None
    """Per local expert, the rows it received from every rank of the group (F, recomputed F, evaluation)."""
    seconds: float = 0.0
    """Wall-clock seconds inside the all-to-alls, forward and backward (CUDA synchronised around each)."""
    calls: int = 0

    def add(self, rows: torch.Tensor) -> None:
        self.rows = rows.cpu() if self.rows is None else self.rows + rows.cpu()

    def take(self) -> tuple[dict[int, int], float]:
        """Rows per expert (by its index in the layer) and seconds since the last call; then starts again."""
        rows = {} if self.rows is None else {self.first + e: int(n) for e, n in enumerate(self.rows.tolist())}
        seconds, self.rows, self.seconds = self.seconds, None, 0.0
        return rows, seconds


@dataclass
class _Handle:
    """What ``combine`` needs of its ``dispatch``: the regrouping and the splits to send back by."""

    order: torch.Tensor
    sent: list[int]
    received: list[int]


class ExpertDispatch:
    """The all-to-all dispatch and combine of one mixture-of-experts layer over an ``ep`` group (module docstring).

    Args:
        ep: the process's expert-parallel group.
        num_experts: the layer's experts, all ranks together (E_total; a multiple of ``ep.size``).
        traffic: where the dispatches count their rows and time (one per stage, shared by its layers).
    """

    def __init__(self, ep: ExpertParallel, num_experts: int, traffic: ExpertTraffic | None = None) -> None:
        if num_experts % ep.size:
            raise ValueError(f"{num_experts} experts do not split over {ep.size} ranks")
        self.ep, self.num_experts = ep, num_experts
        self.local = num_experts // ep.size
        self.first = ep.rank * self.local
        """The global index of this rank's first expert."""
        self.traffic = traffic if traffic is not None else ExpertTraffic()
        self.traffic.first = self.first

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Handle]:
        """Send ``x``'s rows (sorted by expert, ``counts[e]`` of them for expert e of every rank) to their
        experts' ranks; returns the rows this rank's experts take, grouped by local expert (each group in
        source-rank order), the count per local expert, and the handle ``combine`` takes."""
        ranks, local = self.ep.size, self.local
        received = exchange_counts(counts.to(torch.int64).reshape(-1), self.ep.group).view(ranks, local)
        sent = counts.reshape(ranks, local).sum(1).tolist()
        arrived = received.sum(1).tolist()
        rows = self._exchange(x, arrived, sent)
        order = _by_expert(received.to(rows.device))
        per_expert = received.sum(0)
        self.traffic.add(per_expert)
        return rows.index_select(0, order), per_expert, _Handle(order, sent, arrived)

    def combine(self, y: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """The local experts' outputs ``y`` (``dispatch``'s grouping) sent back: rows in ``x``'s order."""
        inverse = torch.empty_like(handle.order)
        inverse[handle.order] = torch.arange(handle.order.numel(), device=handle.order.device)
        return self._exchange(y.index_select(0, inverse), handle.sent, handle.received)

    def _exchange(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        return all_to_all(x, output_splits, input_splits, self.ep.group, self._timed, self.ep.delayed)

    def _timed(self, exchange: Any) -> Any:
        """Run ``exchange()`` counted in ``traffic``."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = exchange()
        if cuda:
            torch.cuda.synchronize()
        self.traffic.seconds += time.perf_counter() - start
        self.traffic.calls += 1
        return out


def _by_expert(received: torch.Tensor) -> torch.Tensor:
    """The permutation taking rows that arrive source-major (rank i's rows for its local experts 0, 1, ...,
    then rank i+1's) to expert-major order (expert 0's rows from ranks 0, 1, ..., then expert 1's).

    Example:
        >>> _by_expert(torch.tensor([[1, 2], [0, 1]])).tolist()  # rank 0 sent 1 + 2 rows, rank 1 sent 0 + 1
        [0, 1, 2, 3]
        >>> _by_expert(torch.tensor([[1, 1], [1, 1]])).tolist()
        [0, 2, 1, 3]
    """
    counts = received.reshape(-1)
    starts = (counts.cumsum(0) - counts).view_as(received).t().reshape(-1)  # each segment's start, expert-major
    lengths = received.t().reshape(-1)
    total = int(lengths.sum())
    target = lengths.cumsum(0) - lengths  # each segment's start in the expert-major order
    shift = torch.repeat_interleave(starts - target, lengths, output_size=total)
    return torch.arange(total, device=received.device) + shift


@dataclass(frozen=True)
class _Handles:
    local: Any
    exchange: _Handle


class AllToAllDispatch:
    """The MoE layer's dispatcher across an ``ep`` group (``models.moe``'s seam): the local grouping by expert
    (``LocalDispatch``) over every expert of the layer, then the all-to-all to the experts' ranks; ``combine``
    the reverse all-to-all, then the gates' weighted sum."""

    def __init__(self, ep: ExpertParallel, num_experts: int, traffic: ExpertTraffic) -> None:
        self.grouping = LocalDispatch(num_experts)
        self.exchange = ExpertDispatch(ep, num_experts, traffic)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int], _Handles]:
        rows, counts, local = self.grouping.dispatch(x, routing)
        mine, per_expert, handle = self.exchange.dispatch(rows, torch.tensor(counts, device=x.device))
        return mine, per_expert.tolist(), _Handles(local, handle)

    def combine(self, y: torch.Tensor, handle: _Handles) -> torch.Tensor:
        return self.grouping.combine(self.exchange.combine(y, handle.exchange), handle.local)


class ExpertShare(nn.Module):
    """One ``ep`` rank's share of a layer's experts, named by their index in the whole layer (``local.<e>``, as
    ``models.moe.Experts`` names them all), so that its parameters are plain training's by name."""

    def __init__(self, experts: dict[int, nn.Module]) -> None:
        super().__init__()
        self.local = nn.ModuleDict({str(e): expert for e, expert in experts.items()})

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (``counts`` each) -> their outputs, in that order (an expert with no row
        runs on none: its gradient is zero)."""
        return torch.cat([expert(chunk) for expert, chunk in zip(self.local.values(), rows.split(counts))])


def shard_experts(layer: nn.Module, ep: ExpertParallel) -> None:
    """Keep ``ep``'s share of the experts of every ``MoE`` under ``layer`` (built whole, plain training's
    weights), mark them (``is_expert``) and give each layer the all-to-all dispatcher.

    Raises:
        UserError: a layer's experts do not split evenly over the ``ep`` group.
    """
    for moe in [m for m in layer.modules() if isinstance(m, MoE)]:
        num = len(moe.experts.local)
        if num % ep.size:
            raise UserError(
                f"--moe-experts {num} do not split over --expert-parallel {ep.size}; give a number of experts "
                f"divisible by {ep.size}, or an --expert-parallel dividing {num}"
            )
        share = num // ep.size
        ids = range(ep.rank * share, (ep.rank + 1) * share)
        moe.experts = ExpertShare({e: moe.experts.local[e] for e in ids})
        mark_expert(moe.experts)
        moe.dispatcher = AllToAllDispatch(ep, num, ExpertTraffic())


def traffic_of(module: nn.Module) -> dict[str, ExpertTraffic]:
    """The traffic counters of ``module``'s expert-parallel MoE layers, by the layer's name."""
    return {
        name: m.dispatcher.exchange.traffic
        for name, m in module.named_modules()
        if isinstance(m, MoE) and isinstance(m.dispatcher, AllToAllDispatch)
    }
