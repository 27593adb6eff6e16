"""Tied weights across stages: parameters that are one (an embedding and the head), kept identical by summing
their gradients.

A model's tied groups (``models.tied``: a built-in transformer's token table and head with
``tie_embeddings``; a ``LayerModel``'s declared ``tied``; those
``pipeweave.pipeline`` finds) start equal. A group whose members all sit in
one stage needs nothing at run time beyond a sum of its distinct copies. A
group split between a pipeline's first and last stage (usually on different
ranks) is exchanged before either stage's update (``TiedGradients.hooks``,
after the replicas of a part are combined): both stages set their members'
gradients to ``first stage's + last stage's``, summed in that order on both
sides, so the copies take bitwise the same step: the gradient a single shared
parameter would get. Between ranks the exchange is one tagged
``isend``/``irecv`` pair at ``U`` carrying every split group's partial sum (one
number when no group is split, so both ranks' message orders stay fixed); in
one process (the reference executor, or both ends on one rank) the first of
the two updates sums for both.

Every rank's ``U`` ends its step in synchronous schedules, so the exchange
waits only on gradients that are complete: it cannot deadlock. In one process
the walk must not run a tied stage's ``U`` before its peer's part is done:
``peer_parts`` names the parts to wait for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.spec import ModelSpec
from pipeweave.models.tied import layer_of
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Placement


def tied_groups(spec: ModelSpec) -> list[list[str]]:
    """The model's tied groups by global name (``models.tied``)."""
    if spec.is_transformer:
        return [["0.token", f"{spec.num_layers - 1}.out.weight"]] if spec.tie_embeddings else []
    return [list(g) for g in spec.custom.tied] if spec.kind == "custom" else []


def spans_parts(spec: ModelSpec, parts: Sequence[range]) -> bool:
    """Whether some tied group of the model has members in two of ``parts`` (the layers of each part): a tie
    the stages exchange, which a stream applies late at its last stage (``runtime.stage.tied_stream``).

    Example:
        >>> gpt = ModelSpec(kind="gpt", layers=2, hidden=8, heads=2, tie_embeddings=True)
        >>> spans_parts(gpt, [range(0, 2), range(2, 4)]), spans_parts(gpt, [range(0, 4)])
        (True, False)
    """
    part = {layer: k for k, layers in enumerate(parts) for layer in layers}
    return any(len({part.get(layer_of(name)) for name in group}) > 1 for group in tied_groups(spec))


def tied_names(worker: StageWorker) -> list[list[str]]:
    """Per tied group, the members this worker holds (empty lists for the others)."""
    held = worker.layer_indices
    return [[n for n in group if layer_of(n) in held] for group in tied_groups(worker.spec)]


def split_groups(worker: StageWorker) -> list[int]:
    """The groups of which this worker holds some members but not all: those it must exchange."""
    return [
        g
        for g, (mine, group) in enumerate(zip(tied_names(worker), tied_groups(worker.spec)))
        if mine and len(mine) < len(group)
    ]


def repeated_members(worker: StageWorker) -> set[int]:
    """Ids of the worker's tied parameters that a gradient norm must not count: every group member but its
    first (their gradients are one, summed before the update), as torch's ``clip_grad_norm_`` counts a shared
    parameter once. A member that is the first one's very object is counted (once) with it."""
    params, groups = worker.named_parameters(), tied_groups(worker.spec)
    later = {id(params[name]) for group in groups for name in group[1:] if name in params}
    return later - {id(params[group[0]]) for group in groups if group[0] in params}


def tie_peer(placement: Placement, stage: int, worker: StageWorker) -> int | None:
    """The stage ``stage`` sums its ties with: the other end of its pipeline for the first and the last
    stage, itself for a stage holding whole groups, None for none.

    Raises:
        UserError: a stage neither first nor last in its pipeline holding part of a group.
    """
    if not tied_groups(worker.spec):
        return None
    line = placement.pipelines[placement.pipeline_of(stage)]
    holds = any(tied_names(worker))
    if line[0] == line[-1]:
        return stage if holds else None
    if stage in (line[0], line[-1]):
        return _other_end(line, stage)
    split = split_groups(worker)
    if split:
        group = tied_groups(worker.spec)[split[0]]
        raise UserError(
            f"tied parameters {', '.join(group)} lie in stage {stage}, inside the pipeline; tied groups "
            "must lie in one stage or in the first and last (re-partition, e.g. --partition uniform)"
        )
    return stage if holds else None


def _other_end(line: tuple[int, ...] | list[int], stage: int) -> int:
    return line[-1] if stage == line[0] else line[0]


def tie_peer_parts(placement: Placement, stage: int, worker: StageWorker) -> tuple[int, ...]:
    """The parts whose gradients ``stage``'s update needs besides its own (for in-process walks)."""
    peer = tie_peer(placement, stage, worker)
    return () if peer is None or peer == stage else (placement.stage_part[peer],)


class TiedGradients:
    """Sums the tied gradients of the first and last stage of each pipeline before their updates.

    Args:
        placement: the schedule's placement.
        workers: the stage workers of this process, by stage.
        rank: this rank, or None when every stage is in this process.
        tag_base: first message tag free for this exchange (distributed only).
        context: this rank's run context (the process of each stage rank; None: every stage in this process).
        first: sum the ties before the replicas' sum, not after (the executor orders ``hooks`` by it): under
            ZeRO-1 that sum reduce-scatters the replicas' gradients, and a tie must be summed whole, before the
            slicing (``runtime.replicas`` then launches the tied parts' reduction at ``U``).

    Attributes:
        hooks: per tied stage of this process, what its ``U`` runs (``StageWorker.update(combine=...)``).
    """

    def __init__(
        self,
        placement: Placement,
        workers: dict[int, StageWorker],
        rank: int | None = None,
        tag_base: int = 0,
        *,
        first: bool = False,
        context: RankContext | None = None,
    ) -> None:
        self.placement, self.workers, self.rank, self.tag_base = placement, workers, rank, tag_base
        self.context = context if context is not None else RankContext()
        self._pending: set[tuple[int, int]] = set()  # local pairs summed once, awaiting the second U
        self.first = first
        self.peer: dict[int, int] = {}
        self.hooks: dict[int, Callable[[StageWorker], None]] = {}
        for stage, worker in workers.items():
            peer = tie_peer(placement, stage, worker)
            if peer is not None:
                self.peer[stage] = peer
                self.hooks[stage] = hook(self._combine, stage)

    def _combine(self, stage: int) -> None:
        peer = self.peer[stage]
        if peer == stage:  # every group it holds is whole here
            write_sums(self.workers[stage], partial_sums(self.workers[stage], whole=True))
        elif peer in self.workers:
            self._combine_local(stage, peer)
        else:
            self._combine_remote(stage, peer)

    def _combine_local(self, stage: int, peer: int) -> None:
        pair = (min(stage, peer), max(stage, peer))
        if pair in self._pending:  # the peer's update already summed for both
            self._pending.remove(pair)
            return
        first, last = self.workers[pair[0]], self.workers[pair[1]]
        if first.layer_indices.start > last.layer_indices.start:
            first, last = last, first
        totals = summed(partial_sums(first), partial_sums(last))
        write_sums(first, totals)
        write_sums(last, totals)
        self._pending.add(pair)

    def _combine_remote(self, stage: int, peer: int) -> None:
        worker = self.workers[stage]
        mine = partial_sums(worker)
        flat = flatten(mine)
        other = torch.empty_like(flat)
        # The peer stage rank's process with this process's tensor-parallel coordinate.
        peer_rank = self.context.process_of(self.placement.stage_rank[peer])
        send = dist.isend(flat.contiguous(), dst=peer_rank, tag=self.tag_base + stage)
        recv = dist.irecv(other, src=peer_rank, tag=self.tag_base + peer)
        assert send is not None and recv is not None
        recv.wait()
        send.wait()
        theirs = unflatten(other, mine)
        line = self.placement.pipelines[self.placement.pipeline_of(stage)]
        # one order on both ranks: the first stage's sum plus the last stage's
        write_sums(worker, summed(mine, theirs) if stage == line[0] else summed(theirs, mine))


def hook(combine: Callable[[int], None], stage: int) -> Callable[[StageWorker], None]:
    """What ``stage``'s ``U`` runs: ``combine(stage)``."""

    def run(worker: StageWorker) -> None:
        combine(stage)

    return run


def partial_sums(worker: StageWorker, whole: bool = False) -> dict[int, torch.Tensor]:
    """Per tied group this worker holds (split ones only, unless ``whole``), the sum of the gradients of its
    distinct copies here, in member order; zeros where none was computed."""
    split = set(range(len(tied_groups(worker.spec)))) if whole else set(split_groups(worker))
    params = dict(worker.module.named_parameters(remove_duplicate=False))
    out: dict[int, torch.Tensor] = {}
    for g, names in enumerate(tied_names(worker)):
        if g not in split or not names:
            continue
        seen: dict[int, nn.Parameter] = {}
        for name in names:
            seen.setdefault(id(params[name]), params[name])
        grads = []
        for p in seen.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        total = grads[0]
        for grad in grads[1:]:
            total = total + grad
        out[g] = total
    return out


def summed(first: dict[int, torch.Tensor], last: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per group, the first stage's sum plus the last stage's: one order on both ends."""
    return {g: first[g] + last[g] for g in first}


def flatten(sums: dict[int, torch.Tensor]) -> torch.Tensor:
    """The groups' sums as one new flat tensor, in group order (one number when there are none)."""
    return torch.cat([t.reshape(-1) for t in sums.values()]) if sums else torch.zeros(1)


def unflatten(flat: torch.Tensor, like: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """``flatten``'s inverse: views of ``flat`` shaped as the groups of ``like``."""
    out, offset = {}, 0
    for g, t in like.items():
        out[g] = flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()
    return out


def write_sums(worker: StageWorker, totals: dict[int, torch.Tensor]) -> None:
    params = dict(worker.module.named_parameters(remove_duplicate=False))
    for g, names in enumerate(tied_names(worker)):
        if g in totals:
            total = totals[g].clone()  # a copy: the sum may be one of the gradients it overwrites
            for name in names:
                params[name].grad.copy_(total)
