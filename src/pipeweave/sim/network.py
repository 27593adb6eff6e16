"""Communication on a cluster: links, ring collectives, and the links a (dp, pp, tp) mesh's groups use.

A message of ``n`` bytes over a link takes ``latency + n / bandwidth`` (the
alpha-beta, or Hockney, model). Bandwidths are per GPU and per direction: on a
DGX A100 each GPU has its own 200 Gb/s InfiniBand card, so the N tensor-parallel
ranks of a node send their pipeline messages side by side, each at the full rate.

Collectives are costed as rings, the algorithm NCCL uses for large messages
and whose costs Thakur, Rabenseifner and Gropp derived ("Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005):

- ``reduce_scatter`` over n ranks: n - 1 steps, each sending 1/n of the data:
  ``(n-1) * latency + (n-1)/n * bytes / bandwidth``;
- ``all_gather``: the same cost, the steps in the other direction;
- ``all_reduce`` = a reduce_scatter followed by an all_gather:
  ``2(n-1) * latency + 2(n-1)/n * bytes / bandwidth``.

A ring is as fast as its slowest link, so a group with ranks on two nodes is
costed at the inter-node link. The reduction arithmetic is not counted.

Ranks are placed as Megatron-LM orders them: tensor-parallel innermost, then
pipeline, then data parallel, ``rank = dp * (D * N) + pp * N + tp`` for a mesh
of P x D x N ranks, and rank r lives on node ``r // gpus_per_node``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pipeweave.errors import UserError


@dataclass(frozen=True, kw_only=True)
class Link:
    """A point-to-point connection: ``latency + bytes / bandwidth``.

    Example:
        >>> Link(bandwidth=1e9, latency=1e-6).time(1e6)
        0.001001
    """

    bandwidth: float
    """Bytes per second, per GPU and direction."""
    latency: float = 0.0
    """Seconds before the first byte arrives (alpha)."""

    def __post_init__(self) -> None:
        if not 0 < self.bandwidth < math.inf:
            raise UserError(f"link bandwidth {self.bandwidth!r} is invalid; give finite bytes per second > 0")
        if not 0 <= self.latency < math.inf:
            raise UserError(f"link latency {self.latency!r} is invalid; give finite seconds >= 0")

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` bytes."""
        return self.latency + nbytes / self.bandwidth


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: ``2(n-1)`` latencies + ``2(n-1)/n`` x bytes / bandwidth.

    Example:
        >>> all_reduce_time(4e9, 4, Link(bandwidth=1e9, latency=0.5))
        9.0
    """
    return _ring_time(nbytes, n, link, passes=2)


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of ``nbytes`` (the whole input) over ``n`` ranks: ``(n-1)`` latencies + ``(n-1)/n`` x bytes / bw.

    Example:
        >>> reduce_scatter_time(4e9, 4, Link(bandwidth=1e9, latency=0.5))
        4.5
    """
    return _ring_time(nbytes, n, link, passes=1)


def _ring_time(nbytes: float, n: int, link: Link, *, passes: int) -> float:
    """``passes`` trips around a ring of ``n`` ranks, each of n - 1 steps carrying ``nbytes / n``."""
    if n <= 1:
        return 0.0
    return passes * ((n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth)


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather into ``nbytes`` (the whole output) over ``n`` ranks; the cost of a reduce-scatter."""
    return reduce_scatter_time(nbytes, n, link)


def hierarchical_time(kind: str, nbytes: float, per_node: int, nodes: int, network: Network) -> float:
    """A collective over ``per_node`` x ``nodes`` ranks, ``per_node`` of them on each node, done as NCCL and
    Megatron-LM's hierarchical reductions do it: inside each node over NVLink, then between nodes on the
    ``1 / per_node`` share each rank holds, every rank of a node on its own network card at once.

    - ``all_reduce``: a reduce-scatter inside the node, an all-reduce of the share between the nodes, an
      all-gather inside the node;
    - ``reduce_scatter``: inside the node, then of the share between the nodes;
    - ``all_gather``: of the share between the nodes, then inside the node.

    With one rank per node it is the flat ring on the network; on one node, the ring on NVLink.

    Example:
        >>> net = Network(intra_node=Link(bandwidth=8.0), inter_node=Link(bandwidth=1.0), gpus_per_node=4)
        >>> hierarchical_time("all_reduce", 16.0, 4, 2, net)  # 2 x 3/4 x 16/8 + 2 x 1/2 x 4/1
        7.0
        >>> hierarchical_time("all_reduce", 16.0, 1, 2, net) == all_reduce_time(16.0, 2, net.inter_node)
        True
    """
    if kind not in HIERARCHICAL:
        raise ValueError(f"collective {kind!r} is unknown; one of {', '.join(HIERARCHICAL)}")
    inside, between = (
        _ring_time(n, k, link, passes=1)
        for n, k, link in (
            (nbytes, per_node, network.intra_node),
            (nbytes / per_node, nodes, network.inter_node),
        )
    )
    if kind == "all_reduce":
        return 2 * inside + 2 * between
    return inside + between


HIERARCHICAL = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives ``hierarchical_time`` costs."""


@dataclass(frozen=True, kw_only=True)
class Network:
    """The links of a cluster of nodes.

    Example:
        >>> net = Network(intra_node=Link(bandwidth=300e9), inter_node=Link(bandwidth=25e9), gpus_per_node=8)
        >>> net.link([0, 7]) is net.intra_node, net.link([7, 8]) is net.inter_node
        (True, True)
    """

    intra_node: Link
    """Between GPUs of one node (NVLink, PCIe, shared memory)."""
    inter_node: Link
    """Between GPUs of different nodes (InfiniBand, Ethernet)."""
    gpus_per_node: int = 8
    """Ranks per node."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise UserError(f"gpus_per_node={self.gpus_per_node} is invalid; give an integer >= 1")

    def node(self, rank: int) -> int:
        """The node that holds ``rank``."""
        return rank // self.gpus_per_node

    def link(self, ranks: Iterable[int]) -> Link:
        """The link a group of ``ranks`` communicates over: inter-node as soon as it spans two nodes."""
        return self.intra_node if len({self.node(r) for r in ranks}) <= 1 else self.inter_node


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """A P x D x N grid of ranks with dimensions (dp, pp, tp), tp innermost (Megatron-LM's order).

    Example:
        >>> m = Mesh(dp=2, pp=2, tp=2)
        >>> m.rank(dp=1, pp=0, tp=1), m.tp_groups()[0], m.dp_groups()[0]
        (5, (0, 1), (0, 4))
    """

    dp: int = 1
    """P, data-parallel replicas of the pipeline."""
    pp: int = 1
    """D, pipeline ranks."""
    tp: int = 1
    """N, tensor-parallel ranks of one stage."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            if getattr(self, name) < 1:
                raise UserError(f"mesh {name}={getattr(self, name)} is invalid; give an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, *, dp: int, pp: int, tp: int) -> int:
        """The global rank of a mesh coordinate."""
        return (dp * self.pp + pp) * self.tp + tp

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Every tensor-parallel group: the ranks of one (dp, pp) coordinate."""
        return [
            tuple(self.rank(dp=d, pp=p, tp=t) for t in range(self.tp)) for d in range(self.dp) for p in range(self.pp)
        ]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Every data-parallel group: the ranks of one (pp, tp) coordinate."""
        return [
            tuple(self.rank(dp=d, pp=p, tp=t) for d in range(self.dp)) for p in range(self.pp) for t in range(self.tp)
        ]

    def hop_pairs(self, a: int, b: int) -> list[tuple[int, int]]:
        """The global rank pairs that carry a message from pipeline rank ``a`` to ``b``: one per (dp, tp)."""
        return [
            (self.rank(dp=d, pp=a, tp=t), self.rank(dp=d, pp=b, tp=t)) for d in range(self.dp) for t in range(self.tp)
        ]


def slowest_link(network: Network, groups: Iterable[Iterable[int]]) -> Link:
    """The link of the slowest of ``groups``: a step waits for every group, so one group across nodes sets the pace.

    Example:
        >>> net = Network(intra_node=Link(bandwidth=2.0), inter_node=Link(bandwidth=1.0), gpus_per_node=4)
        >>> slowest_link(net, Mesh(dp=2, pp=1, tp=2).dp_groups()) is net.intra_node
        True
        >>> slowest_link(net, Mesh(dp=2, pp=2, tp=2).dp_groups()) is net.inter_node
        True
    """
    links = [network.link(group) for group in groups]
    return network.inter_node if network.inter_node in links else network.intra_node
