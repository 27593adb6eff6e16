"""Tensor and data parallelism in the cost model: what a P x D x N layout adds to one pipeline's times and memory.

The model follows what pipeweave's runtime does on a (dp, pp, tp) mesh
(DESIGN.md, Scale); one pipeline is simulated, its P replicas being alike:

- **compute**: a part's F, I and W on N tensor-parallel ranks take 1/N of
  their time (the matrix multiplies split evenly; what does not split, norms
  and element-wise work, is taken as negligible);
- **TP collectives**: Megatron-LM's column- then row-parallel layers without
  sequence parallelism all-reduce a block's activation (b x s x h elements)
  twice in its forward and twice in its input-gradient backward (Shoeybi et
  al. 2019, section 3; a vocabulary head: ``sim.traffic``); they block the
  computation, so they add to F and to I (B = I + W); W has none;
- **pipeline messages**: each of the N ranks of a stage sends its own full
  copy of the activation to the same tp rank of the next stage, in parallel:
  one message time on the link between them (``sim.network``);
- **DP reduction**: a part's gradients (one TP rank's parameter bytes,
  ``traffic.PartBytes.tp_rank_params``) are reduced
  over the dp group, all-reduce (ZeRO 0) or reduce-scatter (ZeRO 1, 3),
  launched when the part's last weight gradient of the step ends; it runs
  beside the rank's remaining backward work and the part's ``U`` waits for it
  (``schedule.dataflow.execute``'s ``update_delay``), so only what sticks out
  past the backward costs time. A group with several ranks on each of
  several nodes reduces hierarchically, inside the nodes then between them on
  each rank's share (``sim.network.hierarchical_time``, as NCCL does), so the
  network carries 1/k of the bytes per rank for k ranks a node; the ring's
  2(n - 1) latencies make it grow with the replicas. Where one pipeline holds a part twice
  (Chimera, GEMS) both copies join the same collective, over 2P ranks;
- **ZeRO** (Rajbhandari et al., SC20): stage 1 shards the optimizer state over
  the P replicas and all-gathers the updated parameters after ``U``; stage 3
  shards parameters and gradients too. The all-gather is added to ``U`` (for
  stage 3 it stands for gathering the next step's parameters);
- **sequence parallelism** (``Layout.sequence_parallel``, Korthikanti et al.
  2022, section 4.2.2, as ``runtime.stage.sequence_parallel`` runs it): each
  TP all-reduce becomes an all-gather entering the column-parallel layer and
  a reduce-scatter leaving the row-parallel one, the same bytes and ring
  steps, so the same time (a head's all-gather of its input in F and
  reduce-scatter in I are counted as its all-reduce in I, and the embedding's
  backward all-gather is left out); a pipeline message is each rank's 1/N of
  the sequence, N of them in parallel. Compute is unchanged: the layer norms
  and residual adds it splits are taken as negligible, as above. What it
  does to activation memory: ``sim.activations``.

Not modelled: link contention between these transfers. Activation memory in
the timeline stays in the cost model's M_a (``sim.activations`` gives bytes
per GPU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipeweave.errors import UserError
from pipeweave.schedule.ir import Schedule
from pipeweave.sim.cost import CostModel, PartCosts, cost_problem
from pipeweave.sim.network import (
    Link,
    Mesh,
    Network,
    all_gather_time,
    all_reduce_time,
    hierarchical_time,
    reduce_scatter_time,
)
from pipeweave.sim.timeline import Timeline, simulate, simulate_parts
from pipeweave.sim.traffic import ModelBytes, PartBytes

ZERO_STAGES = (0, 1, 3)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one pipeline of D ranks is multiplied: N tensor-parallel ranks per stage, P replicas, ZeRO, the network.

    Example:
        >>> from pipeweave.sim.network import Link, Network
        >>> net = Network(intra_node=Link(bandwidth=1e9), inter_node=Link(bandwidth=1e8), gpus_per_node=4)
        >>> Layout(tp=2, dp=2, network=net).mesh(num_ranks=2).world_size
        8
    """

    tp: int = 1
    """N, tensor-parallel ranks per stage (innermost: on one node where they fit)."""
    dp: int = 1
    """P, data-parallel replicas of the pipeline."""
    zero: int = 0
    """ZeRO stage: 0 replicates everything, 1 shards optimizer state, 3 parameters, gradients and state too."""
    network: Network | None = None
    """The cluster's links; None: communication takes no time (only compute shrinks by N)."""
    bucket_bytes: float = 0.0
    """Gradient bytes per DP collective (DDP's buckets); 0: one collective per part."""
    sequence_parallel: bool = False
    """Activations outside the tensor-parallel regions split along the sequence (Korthikanti et al. 2022): the
    same bytes per collective (an all-gather and a reduce-scatter for each all-reduce), pipeline messages of 1/N
    of the sequence, fewer activations held (``sim.activations``). No effect at N = 1."""

    def __post_init__(self) -> None:
        for name, value in (("tp", self.tp), ("dp", self.dp)):
            if value < 1:
                raise UserError(f"layout {name}={value} is invalid; give an integer >= 1")
        if self.zero not in ZERO_STAGES:
            raise UserError(f"ZeRO stage {self.zero} is invalid; give one of 0, 1, 3")
        problem = cost_problem(self.bucket_bytes, "number of bytes")
        if problem is not None:
            raise UserError(f"bucket_bytes={self.bucket_bytes!r} {problem}")

    @property
    def trivial(self) -> bool:
        """One rank per stage, one replica, no network: today's pipeline-only model."""
        return self.tp == 1 and self.dp == 1 and self.network is None

    def mesh(self, *, num_ranks: int) -> Mesh:
        """The P x D x N mesh of a pipeline of ``num_ranks`` (D) ranks."""
        return Mesh(dp=self.dp, pp=num_ranks, tp=self.tp)

    def tp_link(self, *, num_ranks: int) -> Link | None:
        """The link of the tensor-parallel groups (inter-node when one of them spans two nodes)."""
        return _group_links(self, num_ranks)[0]

    def dp_link(self, *, num_ranks: int) -> Link | None:
        """The link of the data-parallel groups."""
        return _group_links(self, num_ranks)[1]

    def hop_link(self, a: int, b: int, *, num_ranks: int) -> Link | None:
        """The link of a message from pipeline rank ``a`` to ``b`` (inter-node when any (dp, tp) pair crosses)."""
        if self.network is None:
            return None
        mesh, net = self.mesh(num_ranks=num_ranks), self.network
        # a pair's nodes repeat when d grows by a node's worth of D x N ranks: one period of replicas tells all
        period = min(mesh.dp, net.gpus_per_node // math.gcd(mesh.pp * mesh.tp, net.gpus_per_node))
        pairs = (
            (mesh.rank(dp=d, pp=a, tp=t), mesh.rank(dp=d, pp=b, tp=t)) for d in range(period) for t in range(mesh.tp)
        )
        return _link(net, any(net.node(x) != net.node(y) for x, y in pairs))


@functools.lru_cache(maxsize=1024)
def _group_links(layout: Layout, num_ranks: int) -> tuple[Link | None, Link | None]:
    """``(tp link, dp link)``, once per layout: every group of the mesh is looked at (thousands on a cluster)."""
    if layout.network is None:
        return None, None
    mesh, net = layout.mesh(num_ranks=num_ranks), layout.network
    g, stride = net.gpus_per_node, mesh.pp * mesh.tp
    # Ranks ascend along a group and a node is a run of ranks, so a group spans two nodes exactly when its first
    # and last do; and the pattern repeats every node's worth of groups: never a walk over millions of them.
    tp_cross = any(
        net.node(k * mesh.tp) != net.node(k * mesh.tp + mesh.tp - 1)
        for k in range(min(mesh.dp * mesh.pp, g // math.gcd(mesh.tp, g)))
    )
    dp_cross = any(net.node(c) != net.node(c + (mesh.dp - 1) * stride) for c in range(min(stride, g)))
    return _link(net, tp_cross), _link(net, dp_cross)


def _link(network: Network, crosses: bool) -> Link:
    return network.inter_node if crosses else network.intra_node


def tp_collective_time(layout: Layout, nbytes: float, *, num_ranks: int) -> float:
    """One TP all-reduce of ``nbytes`` (0 without a network or at N = 1)."""
    link = layout.tp_link(num_ranks=num_ranks)
    return 0.0 if link is None else _all_reduce(layout, nbytes, link)


def _all_reduce(layout: Layout, nbytes: float, link: Link) -> float:
    """A TP all-reduce of ``nbytes``, or with sequence parallelism the all-gather and reduce-scatter replacing it."""
    if layout.sequence_parallel:
        return all_gather_time(nbytes, layout.tp, link) + reduce_scatter_time(nbytes, layout.tp, link)
    return all_reduce_time(nbytes, layout.tp, link)


def message_bytes(layout: Layout, nbytes: float) -> float:
    """What one rank of a stage sends the same TP rank of the next for an activation of ``nbytes``: all of it,
    or with sequence parallelism its 1/N of the sequence.

    Example:
        >>> message_bytes(Layout(tp=4), 8.0), message_bytes(Layout(tp=4, sequence_parallel=True), 8.0)
        (8.0, 2.0)
    """
    return nbytes / layout.tp if layout.sequence_parallel else nbytes


def tp_forward_time(layout: Layout, parts: PartBytes, part: int, *, num_ranks: int) -> float:
    """The TP collectives of one F of ``part``: its all-reduces and its all-gather (0 without a network)."""
    link = layout.tp_link(num_ranks=num_ranks)
    if link is None:
        return 0.0
    gather = parts.tp_gather[part]
    return parts.tp_forward[part] * _all_reduce(layout, parts.tp_message[part], link) + (
        all_gather_time(gather, layout.tp, link) if gather else 0.0
    )


def tp_backward_time(layout: Layout, parts: PartBytes, part: int, *, num_ranks: int) -> float:
    """The TP all-reduces of one I (or B) of ``part``."""
    return parts.tp_backward[part] * tp_collective_time(layout, parts.tp_message[part], num_ranks=num_ranks)


def reduction_time(layout: Layout, grad_bytes: float, *, num_ranks: int, holders: tuple[int, ...] = ()) -> float:
    """The DP reduction of one part's gradients (``grad_bytes`` of one TP rank), in DP buckets.

    ``holders`` are the pipeline ranks holding the part when a pipeline has it more than once
    (Chimera, GEMS): their gradients join the same collective, over P x len(holders) ranks.

    Example:
        >>> from pipeweave.sim.network import Link, Network
        >>> net = Network(intra_node=Link(bandwidth=1.0), inter_node=Link(bandwidth=1.0))
        >>> reduction_time(Layout(dp=2, network=net), 8.0, num_ranks=1)  # all-reduce: 2 (2-1)/2 x 8 / 1
        8.0
    """
    n, link = _reduction_group(layout, num_ranks, holders)
    if link is None or n == 1 or grad_bytes == 0:
        return 0.0
    split = _node_split(layout, num_ranks, holders)
    if split is not None:
        kind = "all_reduce" if layout.zero == 0 else "reduce_scatter"
        return sum(_hierarchical(kind, size, split, layout) for size in _buckets(grad_bytes, layout.bucket_bytes))
    collective = all_reduce_time if layout.zero == 0 else reduce_scatter_time
    return sum(collective(size, n, link) for size in _buckets(grad_bytes, layout.bucket_bytes))


def gather_time(layout: Layout, param_bytes: float, *, num_ranks: int, holders: tuple[int, ...] = ()) -> float:
    """ZeRO's all-gather of one part's updated parameters (``param_bytes`` of one TP rank) after its ``U``."""
    n, link = _reduction_group(layout, num_ranks, holders)
    if link is None or layout.zero == 0 or n == 1:
        return 0.0
    split = _node_split(layout, num_ranks, holders)
    if split is not None:
        return sum(
            _hierarchical("all_gather", size, split, layout) for size in _buckets(param_bytes, layout.bucket_bytes)
        )
    return sum(all_gather_time(size, n, link) for size in _buckets(param_bytes, layout.bucket_bytes))


def _hierarchical(kind: str, nbytes: float, split: tuple[int, int], layout: Layout) -> float:
    assert layout.network is not None
    return hierarchical_time(kind, nbytes, *split, layout.network)


@functools.lru_cache(maxsize=4096)
def _node_split(layout: Layout, num_ranks: int, holders: tuple[int, ...]) -> tuple[int, int] | None:
    """``(ranks per node, nodes)`` of a data-parallel group that has several ranks on each of several nodes
    (then reduced hierarchically: ``sim.network.hierarchical_time``), None otherwise (a flat ring: the group
    on one node, one rank per node, a part held twice in a pipeline, or groups that straddle nodes unevenly).

    Example:
        >>> from pipeweave.sim.network import Link, Network
        >>> net = Network(intra_node=Link(bandwidth=1.0), inter_node=Link(bandwidth=1.0), gpus_per_node=8)
        >>> _node_split(Layout(tp=2, dp=16, network=net), 1, ()), _node_split(Layout(tp=8, dp=16, network=net), 1, ())
        ((4, 4), None)
    """
    if layout.network is None or len(holders) > 1:
        return None
    stride, per_node = num_ranks * layout.tp, layout.network.gpus_per_node  # a group's ranks are stride apart
    if stride >= per_node or per_node % stride:
        return None
    share = per_node // stride
    if layout.dp <= share or layout.dp % share:
        return None
    return share, layout.dp // share


@functools.lru_cache(maxsize=4096)
def _reduction_group(layout: Layout, num_ranks: int, holders: tuple[int, ...]) -> tuple[int, Link | None]:
    """``(ranks, link)`` of the collective that combines a part's gradients held on pipeline ranks ``holders``."""
    if len(holders) <= 1 or layout.network is None:
        return layout.dp, layout.dp_link(num_ranks=num_ranks)
    mesh, net = layout.mesh(num_ranks=num_ranks), layout.network
    low, high = min(holders), max(holders)  # a group's least and greatest ranks (``_group_links``: they decide)
    crosses = any(
        net.node(mesh.rank(dp=0, pp=low, tp=t)) != net.node(mesh.rank(dp=layout.dp - 1, pp=high, tp=t))
        for t in range(layout.tp)
    )
    return layout.dp * len(holders), _link(net, crosses)


def _buckets(nbytes: float, bucket: float) -> list[float]:
    """``nbytes`` cut into buckets of ``bucket`` bytes, the last one what remains (one piece when bucket is 0)."""
    if bucket <= 0 or nbytes <= bucket:
        return [nbytes]
    full = math.floor(nbytes / bucket)
    rest = nbytes - full * bucket
    return [bucket] * full + ([rest] if rest > 0 else [])


def layout_costs(
    costs: PartCosts,
    layout: Layout,
    parts: PartBytes,
    *,
    num_ranks: int,
    split_compute: bool = True,
    holders: Sequence[tuple[int, ...]] = (),
) -> PartCosts:
    """Per-part costs on the layout: compute / N (unless ``split_compute`` is False, for times already
    per TP rank), TP all-reduces added to F and I, ZeRO's all-gather added to U (over the part's
    ``holders`` too, ``part_holders``, where a pipeline has a part more than once).

    Example:
        >>> from pipeweave.sim.cost import CostModel
        >>> c = CostModel(f=4.0, b=4.0, w=2.0).for_parts(num_parts=2, num_ranks=2)
        >>> layout_costs(c, Layout(tp=2), ModelBytes().for_parts(num_parts=2, num_ranks=2), num_ranks=2).f
        (2.0, 2.0)
    """
    n = layout.tp if split_compute else 1
    k = range(len(costs.f))
    forward = [tp_forward_time(layout, parts, part, num_ranks=num_ranks) for part in k]
    backward = [tp_backward_time(layout, parts, part, num_ranks=num_ranks) for part in k]
    gather = [
        gather_time(layout, parts.tp_rank_params(part, layout.tp), num_ranks=num_ranks, holders=h)
        for part, h in zip(k, holders or [()] * len(k))
    ]
    return replace(
        costs,
        f=tuple(f / n + c for f, c in zip(costs.f, forward)),
        b=tuple(b / n + c for b, c in zip(costs.b, backward)),
        w=tuple(w / n for w in costs.w),
        u=tuple(u + g for u, g in zip(costs.u, gather)),
    )


def layout_times(
    layout: Layout,
    *,
    f: float,
    b: float,
    w: float,
    comm: float,
    message: float,
    tp_collectives: float,
    num_ranks: int,
    split_compute: bool = True,
) -> tuple[float, float, float, float]:
    """``(f, b, w, comm)`` of one D-th of the model on the layout, for a search that takes scalar times:
    ``layout_costs``' rules, and ``comm`` plus the slowest hop between neighbouring pipeline ranks
    (``message_bytes`` of ``message``).

    Example:
        >>> layout_times(Layout(tp=2), f=2.0, b=2.0, w=1.0, comm=0.1, message=0.0, tp_collectives=2, num_ranks=4)
        (1.0, 1.0, 0.5, 0.1)
    """
    n = layout.tp if split_compute else 1
    collective = tp_collectives * tp_collective_time(layout, message, num_ranks=num_ranks)
    links = [layout.hop_link(a, a + 1, num_ranks=num_ranks) for a in range(num_ranks - 1)]
    hop = max((link.time(message_bytes(layout, message)) for link in links if link is not None), default=0.0)
    return f / n + collective, b / n + collective, w / n, comm + hop


def hop_function(schedule: Schedule, layout: Layout, parts: PartBytes, comm: float) -> Callable[[int, int], float]:
    """``(from stage, to stage) -> time`` of a pipeline message: ``comm`` plus the link's time for the
    activation at the boundary of the two stages' parts (the earlier part's output; ``message_bytes`` of it)."""
    placement, num_ranks = schedule.placement, schedule.placement.ranks_per_pipeline
    rank_of, part_of = placement.stage_rank, placement.stage_part
    cache: dict[tuple[int, int], float] = {}

    def hop(src: int, dst: int) -> float:
        key = (src, dst)
        time = cache.get(key)
        if time is None:
            link = layout.hop_link(rank_of[src] % num_ranks, rank_of[dst] % num_ranks, num_ranks=num_ranks)
            nbytes = message_bytes(layout, parts.message[min(part_of[src], part_of[dst])])
            time = cache[key] = comm + (0.0 if link is None else link.time(nbytes))
        return time

    return hop


def part_holders(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per part, the pipeline ranks holding it (one, unless a pipeline replicates parts: Chimera, GEMS).

    Example:
        >>> from pipeweave.schedule import generate
        >>> part_holders(generate("chimera", num_stages=4, num_microbatches=4))
        ((0, 3), (1, 2), (1, 2), (0, 3))
    """
    placement = schedule.placement
    ranks: list[set[int]] = [set() for _ in range(schedule.num_parts)]
    for stage, rank in enumerate(placement.stage_rank):
        ranks[placement.stage_part[stage]].add(rank % placement.ranks_per_pipeline)
    return tuple(tuple(sorted(r)) for r in ranks)


def reduction_times(schedule: Schedule, layout: Layout, parts: PartBytes) -> tuple[float, ...]:
    """Per part, its DP reduction (``reduction_time`` of its gradient bytes, over its holders too)."""
    num_ranks = schedule.placement.ranks_per_pipeline
    return tuple(
        reduction_time(layout, parts.tp_rank_params(part, layout.tp) * parts.grads, num_ranks=num_ranks, holders=h)
        for part, h in enumerate(part_holders(schedule))
    )


def simulate_layout(
    schedule: Schedule,
    cost: CostModel | None,
    layout: Layout,
    model: ModelBytes | None = None,
    *,
    check: bool = True,
    split_compute: bool = True,
    reduce: bool = True,
    fast: bool = True,
) -> Timeline:
    """Time one pipeline of ``schedule`` on the layout: ``simulate`` with TP and DP added.

    Args:
        schedule: a schedule of one pipeline (its D ranks); the layout's P replicas are alike.
        cost: the cost model of the part's compute (times of the whole stage, one GPU); default uniform.
        layout: TP, DP, ZeRO and the network. A trivial one gives ``simulate``'s timeline exactly.
        model: the bytes moved and stored (default: none, so only latencies and compute / N count).
        check: validate the schedule first.
        split_compute: False when ``cost``'s times are already those of one TP rank.
        reduce: False leaves the DP reductions out (to measure what they add).
        fast: the fast engines (``sim.rounds``, ``sim.compiled``); False forces the pure-Python reference (same
            times).

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = generate("1f1b", num_stages=2, num_microbatches=2)
        >>> simulate_layout(s, CostModel(f=2.0, b=2.0, w=2.0), Layout(tp=2)).events[0][0].end
        1.0
    """
    cost = cost or CostModel()
    if layout.trivial:
        return simulate(schedule, cost, check=check, fast=fast)
    num_ranks, num_parts = schedule.placement.ranks_per_pipeline, schedule.num_parts
    parts = (model or ModelBytes()).for_parts(num_parts=num_parts, num_ranks=num_ranks)
    costs = layout_costs(
        cost.for_parts(num_parts=num_parts, num_ranks=num_ranks),
        layout,
        parts,
        num_ranks=num_ranks,
        split_compute=split_compute,
        holders=part_holders(schedule),
    )
    delays = reduction_times(schedule, layout, parts) if reduce else None
    hop = hop_function(schedule, layout, parts, costs.comm) if layout.network is not None or costs.comm else None
    return simulate_parts(schedule, costs, check=check, hop=hop, update_delay=delays, fast=fast)
