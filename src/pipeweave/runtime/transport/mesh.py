"""The device mesh of a run: data x pipeline x context x tensor parallelism (experts split over ``ep``), and its
process groups.

A run of P pipeline replicas of a D-rank schedule with C-way context
parallelism and N-way tensor parallelism has P x D x C x N processes on one
``torch.distributed.DeviceMesh`` of shape ``(P, D, C, N)``, dimensions named
``dp``, ``pp``, ``cp``, ``tp``, in Megatron-LM's order: TP innermost (a TP
group on consecutive ranks, one node), then CP, then the pipeline, then data
parallelism, so process ``((dp*D + pp)*C + cp)*N + tp``; without context
parallelism (C = 1) the mesh is ``(P, D, N)`` with ``dp``, ``pp``, ``tp``
and process ``dp*D*N + pp*N + tp``. The lowered schedule
(``schedule.data_parallel`` already lays the P replicas out as ``dp*D + pp``)
is run by every process of a stage rank's C x N alike: its **stage rank** is
``process // (C*N)``, and its messages go to the process of the peer stage
rank with the same ``cp`` and ``tp`` coordinates (``process_of``).

Groups: ``tp`` (the N ranks that split each layer), ``cp`` (the C ranks that
split each sequence, ``runtime.stage.context_parallel``), ``pipeline`` (the
P x D processes of one ``(cp, tp)`` coordinate, which sum the loss), and per
replicated part the processes holding its replicas with this ``(cp, tp)``
coordinate (``Mesh.replica_groups``: the ``dp`` dimension's group for plain
data parallelism, groups of their own for Chimera, GEMS or DualPipe, whose
replicas share a pipeline). Every process creates every group in one order,
as ``torch.distributed`` asks. Without tensor or context parallelism or
replicas on several ranks no group is created: process and stage rank coincide.

Expert parallelism (``--expert-parallel E``) splits the ``dp`` dimension as
Megatron-LM and torchtitan do: the E consecutive replicas ``dp = g*E + j``
(``j < E``) of one (pp, cp, tp) coordinate form an ``ep`` group, each holding
1/E of every mixture-of-experts layer's experts (``ep`` rank j: the j-th
share) and exchanging tokens by all-to-all (``stage.expert_parallel``). A
part's dense parameters are summed over its replica group as before; its
experts only over the replicas holding the same share, those of one ``j``
(``Mesh.expert_groups``; none where P = E: each share is held once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeweave.schedule.ir import Placement

MEASURING = "measuring"
"""A ``TensorParallel.group`` that communicates nothing: one process's shapes, without its peers, for
counting the bytes a process holds before any process exists (``runtime.run.part_memory``). Never for training."""


@dataclass(frozen=True)
class TensorParallel:
    """A process's place in its tensor-parallel group: the group, its rank in it, its size N."""

    group: Any
    """The ``torch.distributed`` process group of the N processes that split each layer (or ``MEASURING``)."""
    rank: int
    size: int
    sequence_parallel: bool = False
    """Activations between the tensor-parallel regions sharded along the sequence (``stage.sequence_parallel``)."""


@dataclass(frozen=True)
class ContextParallel:
    """A process's place in its context-parallel group: the group, its rank in it, its size C."""

    group: Any
    """The ``torch.distributed`` process group of the C processes that split each sequence."""
    rank: int
    size: int


@dataclass(frozen=True)
class ExpertParallel:
    """A process's place in its expert-parallel group: the group, its rank in it (which share of the experts it
    holds), its size E."""

    group: Any
    """The ``torch.distributed`` process group of the E processes exchanging tokens by all-to-all."""
    rank: int
    size: int
    delayed: Any = None
    """What each all-to-all's posted work passes through before the wait (``RankContext.delayed``: an injected
    link delay, a testing aid); None: waited on as it is."""


@dataclass
class Mesh:
    """One process's coordinates in the run's mesh, and the groups it takes part in."""

    data_parallel: int
    stages: int
    """D: stage ranks of one pipeline replica."""
    tensor_parallel: int
    process: int
    """This process's rank in the default group."""
    device_mesh: DeviceMesh | None = None
    tp_group: Any = None
    pipeline_group: Any = None
    replica_groups: dict[int, Any] = field(default_factory=dict)
    """Per replicated part whose replicas span several stage ranks: the group summing its gradients."""
    outside: bool = False
    """The schedule is one replica's (an asynchronous one's D ranks), the P replicas laid out around it; else
    it holds them (``schedule.data_parallel``: ranks ``dp*D + pp``)."""
    dp_group: Any = None
    """The processes of this one's (pp, cp, tp) coordinate across the replicas (with ``outside``)."""
    context_parallel: int = 1
    """C: processes splitting every sequence (``runtime.stage.context_parallel``)."""
    cp_group: Any = None
    expert_parallel: int = 1
    """E: replicas of one (pp, cp, tp) coordinate splitting the experts among them (1: every replica holds all)."""
    ep_group: Any = None
    """The E processes of this one's ``ep`` group (E > 1): the experts' all-to-all."""
    expert_groups: dict[int, Any] = field(default_factory=dict)
    """Per replicated part on this process (E > 1): the group summing its experts' gradients (the part's
    replicas holding this process's share), None where no other process holds it."""

    @property
    def per_stage_rank(self) -> int:
        """C x N: the processes of one stage rank, which run its actions alike."""
        return self.context_parallel * self.tensor_parallel

    @property
    def stage_rank(self) -> int:
        """This process's rank in the lowered schedule (``dp*D + pp``; with ``outside``, ``pp``)."""
        rank = self.process // self.per_stage_rank
        return rank % self.stages if self.outside else rank

    @property
    def dp_rank(self) -> int:
        return self.process // (self.stages * self.per_stage_rank)

    @property
    def tp_rank(self) -> int:
        return self.process % self.tensor_parallel

    @property
    def cp_rank(self) -> int:
        return self.process // self.tensor_parallel % self.context_parallel

    @property
    def ep_rank(self) -> int:
        """Which share of the experts this process holds: its place in its ``ep`` group."""
        return self.dp_rank % self.expert_parallel

    def process_of(self, stage_rank: int) -> int:
        """The process of ``stage_rank`` with this process's ``cp`` and ``tp`` (and, ``outside``, ``dp``)
        coordinates."""
        first = self.dp_rank * self.stages if self.outside else 0
        return (first + stage_rank) * self.per_stage_rank + self.process % self.per_stage_rank

    @property
    def tensor_parallel_group(self) -> TensorParallel | None:
        """What the stage workers split their layers over (None without tensor parallelism)."""
        if self.tensor_parallel == 1:
            return None
        return TensorParallel(self.tp_group, self.tp_rank, self.tensor_parallel)

    @property
    def context_parallel_group(self) -> ContextParallel | None:
        """What the stage workers split their sequences over (None without context parallelism)."""
        if self.context_parallel == 1:
            return None
        return ContextParallel(self.cp_group, self.cp_rank, self.context_parallel)

    @property
    def expert_parallel_group(self) -> ExpertParallel | None:
        """What the stage workers split their experts over (None without expert parallelism)."""
        if self.expert_parallel == 1:
            return None
        return ExpertParallel(self.ep_group, self.ep_rank, self.expert_parallel)


def process_pairs(
    pairs: set[tuple[int, int]], *, stage_ranks: int, tensor_parallel: int = 1, replicas: int = 1
) -> set[tuple[int, int]]:
    """The pairs of processes that ``pairs`` of stage ranks (``transport.order.message_pairs``) connect.

    A message goes between the processes of the two stage ranks with one
    ``tp`` coordinate (``Mesh.process_of``), in every ``tp`` coordinate (give
    ``tensor_parallel`` C x N under context parallelism: every ``(cp, tp)`` one) and,
    for an asynchronous schedule of ``stage_ranks`` ranks with ``replicas``
    data-parallel replicas laid out around it, in every replica.

    Example:
        >>> sorted(process_pairs({(0, 1)}, stage_ranks=2, tensor_parallel=2))
        [(0, 2), (1, 3)]
    """
    n = tensor_parallel
    return {
        ((r * stage_ranks + a) * n + t, (r * stage_ranks + b) * n + t)
        for a, b in pairs
        for t in range(n)
        for r in range(replicas)
    }


def replica_rank_sets(placement: Placement) -> dict[int, tuple[int, ...]]:
    """Per part whose replicas lie on more than one stage rank, those stage ranks, ascending."""
    out: dict[int, tuple[int, ...]] = {}
    for part in range(placement.num_parts):
        stages = placement.replicas(placement.stage_part.index(part))
        ranks = tuple(sorted({placement.stage_rank[s] for s in stages}))
        if len(ranks) > 1:
            out[part] = ranks
    return out


def build_mesh(
    process: int,
    world: int,
    placement: Placement,
    data_parallel: int,
    tensor_parallel: int,
    device: torch.device,
    context_parallel: int = 1,
    expert_parallel: int = 1,
) -> Mesh:
    """This process's ``Mesh``, every group created (a collective call: every process of the run calls it)."""
    inner = tensor_parallel * context_parallel
    ranks = world // inner
    outside = placement.num_ranks != ranks  # an asynchronous schedule's replicas, laid out around it
    mesh = Mesh(
        data_parallel,
        ranks // data_parallel,
        tensor_parallel,
        process,
        outside=outside,
        context_parallel=context_parallel,
        expert_parallel=expert_parallel,
    )
    if inner == 1 and not outside and not replica_rank_sets(placement):
        return mesh
    if context_parallel > 1:
        shape, names = (data_parallel, mesh.stages, context_parallel, tensor_parallel), ("dp", "pp", "cp", "tp")
    else:
        shape, names = (data_parallel, mesh.stages, tensor_parallel), ("dp", "pp", "tp")
    mesh.device_mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    mesh.tp_group = mesh.device_mesh.get_group("tp")
    mesh.cp_group = mesh.device_mesh.get_group("cp") if context_parallel > 1 else None
    mesh.dp_group = mesh.device_mesh.get_group("dp")
    mesh.pipeline_group = _group_per_tp([list(range(ranks))], mesh)[0] if inner > 1 else None
    sets = replica_rank_sets(placement)
    # Plain data parallelism: a part's replicas are a slice of the mesh's dp dimension, whose group exists.
    along_dp = {part: r == tuple(range(r[0], ranks, mesh.stages)) and r[0] < mesh.stages for part, r in sets.items()}
    others = [part for part in sets if not along_dp[part]]
    created = dict(zip(others, _group_per_tp([list(sets[part]) for part in others], mesh)))
    for part in sets:
        mesh.replica_groups[part] = mesh.device_mesh.get_group("dp") if along_dp[part] else created[part]
    if expert_parallel > 1:
        _expert_groups(mesh, sets)
    return mesh


def _expert_groups(mesh: Mesh, sets: dict[int, tuple[int, ...]]) -> None:
    """``mesh``'s ``ep`` group and, per replicated part, the group of its replicas holding this share of the
    experts (``ep`` coordinate ``dp % E``); every process creates every group, in one order."""
    E, D = mesh.expert_parallel, mesh.stages
    ep_sets = [[(g * E + j) * D + pp for j in range(E)] for g in range(mesh.data_parallel // E) for pp in range(D)]
    mine = mesh.process // mesh.per_stage_rank
    for ranks, group in zip(ep_sets, _group_per_tp(ep_sets, mesh)):
        if mine in ranks:
            mesh.ep_group = group
    for part, ranks in sets.items():
        shares = [[r for r in ranks if r // D % E == j] for j in range(E)]
        held = [share for share in shares if len(share) > 1]
        for share, group in zip(held, _group_per_tp(held, mesh)):
            if mine in share:
                mesh.expert_groups[part] = group
        if mine in ranks:
            mesh.expert_groups.setdefault(part, None)


def _group_per_tp(stage_rank_sets: list[list[int]], mesh: Mesh) -> list[Any]:
    """For each set of stage ranks, the group of its processes with this ``(cp, tp)`` coordinate.

    Every process creates the groups of every ``(cp, tp)`` coordinate, in one order; it keeps its own.
    """
    mine: list[Any] = []
    inner = mesh.per_stage_rank
    for ranks in stage_rank_sets:
        for t in range(inner):
            group = dist.new_group([r * inner + t for r in ranks])
            if t == mesh.process % inner:
                mine.append(group)
    return mine
