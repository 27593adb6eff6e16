"""The gradients of a part's replicas summed by collectives, in buckets, overlapped with the backward.

A part held by several stages -- the P pipeline replicas of data
parallelism, or the replicas Chimera, GEMS and DualPipe place inside one
pipeline -- must apply one update: the sum of every replica's gradient (each
microbatch's loss is already scaled by its share of the global batch). As
DDP and Megatron-LM do, the part's gradients are flattened into buckets of
about ``bucket_bytes`` and each bucket is all-reduced over the part's
replica group (``transport.mesh.replica_group``) with ``async_op``, launched
as soon as the last action of the step that adds to the part's gradients
(its last ``W``, or ``B``) has run on this rank: the reduction then runs
while the rank computes the rest of its backward, and the part's ``U`` waits
for it. Replicas on this rank are summed first, in stage order.

Under expert parallelism (``Mesh.expert_groups``) a part's parameters go in
buckets of two kinds: the dense ones, summed over the part's replica group,
and the experts (``stage.expert_parallel.is_expert``), summed only over the
replicas that hold the same experts -- the others hold other experts.

With ZeRO-1 (``zero=1``, ``runtime.zero``) each bucket is reduce-scattered
instead, and the part's optimizer, sharded, steps the slice it receives and
all-gathers the parameters after; a part holding tied parameters
(``stage.tied``) is reduced at its ``U`` instead, after the tie's sum, which
must see whole gradients, not slices. With ZeRO-2 (``zero=2``) the part's
gradient is reduce-scattered after each action that adds to it instead of
once (a microbatch's ``B`` or ``W``), the whole gradients freed as each
bucket is flattened; the slices received are added into the optimizer's
(``ZeroOptimizer.accumulate_gradients``), a reduce-scatter waited for when
the part's next one is launched, or at its ``U``. With ZeRO-3 (``zero=3``) the part is
FSDP2's (``runtime.fsdp``): launching its reduction is FSDP's reduce-scatter,
driven at the same point.

A group's members launch the same buckets in the same order (one launch per
part and step, each part its own group), so the collectives match. The
result of an all-reduce is the same on every member, so the replicas apply
bitwise the same update and stay equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from pipeweave.runtime.fsdp import FullyShardedPart, shard_stage
from pipeweave.runtime.stage.build import Stage
from pipeweave.runtime.stage.expert_parallel import is_expert
from pipeweave.runtime.stage.tied import tied_names
from pipeweave.runtime.stage.worker import Combine, StageWorker
from pipeweave.runtime.zero import ZeroOptimizer, pad
from pipeweave.schedule.ir import Action, Placement

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Bytes of gradients per all-reduce (DDP's default ``bucket_cap_mb``)."""


class ReplicaReduction:
    """Sums the gradients of every replicated part on this rank before its ``U``.

    Args:
        placement: the schedule's placement.
        row: this rank's actions of a step.
        workers: this rank's stage workers; ``hooks`` holds what each replica's ``U`` runs first.
        groups: per replicated part spanning several ranks, the process group of its replicas.
        bucket_bytes: the size of a bucket (the last one of a part may be smaller).
        zero: the ZeRO stage (0, 1, 2 or 3) of the parts whose replicas lie one per rank on several ranks: their
            workers were built with ``zero.ZeroOptimizer``s over the same buckets (1, 2), or their layers fully
            sharded over the run's ``dp`` mesh (3: ``fsdp.FullyShardedPart``, ``worker.shards``), by the
            run's build step ``shard_replica`` (``runtime.run.workers``).
        expert_groups: under expert parallelism, per replicated part, the group summing its experts' gradients
            (None: no other rank holds this rank's experts); its dense parameters stay ``groups``'s.
    """

    def __init__(
        self,
        placement: Placement,
        row: Sequence[Action],
        workers: dict[int, StageWorker],
        groups: dict[int, Any],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        zero: int = 0,
        expert_groups: dict[int, Any] | None = None,
    ) -> None:
        self.placement, self.workers, self.groups = placement, workers, groups
        self.bucket_bytes = bucket_bytes
        # Per replicated part on this rank: its local replica stages, ascending.
        self.local: dict[int, list[int]] = {}
        self.hooks: dict[int, Combine] = {}
        """Per replicated stage of this rank, what its ``U`` runs first: the part's replicas' sum."""
        for s in sorted(workers):
            if len(placement.replicas(s)) > 1:
                self.local.setdefault(placement.stage_part[s], []).append(s)
                self.hooks[s] = self._combine
        # Per part, how many of the step's actions add to its gradients here.
        self.grad_actions = {part: 0 for part in self.local}
        for a in row:
            part = placement.stage_part[a.stage]
            if part in self.local and a.op.computes_weight_grad:
                self.grad_actions[part] += 1
        self.spans = {part: self._spans(part, expert_groups or {}) for part in self.local}
        """Per part, its buckets: the indices of the parameters in each, and the group summing it."""
        self.sharded = {part for part in self.local if zero and part in groups}
        self.per_action = {part for part in self.sharded if zero == 2}  # ZeRO-2: reduced after each B or W
        # ZeRO-1 parts holding tied parameters: reduced at U, after the tie's sum (``TiedGradients(first=True)``).
        self.at_update = {part for part in self.sharded if zero == 1 and any(tied_names(workers[self.local[part][0]]))}
        self.fully_sharded: dict[int, FullyShardedPart] = {}
        for part in self.sharded:
            (stage,) = self.local[part]  # the plan refuses ZeRO where a rank holds two replicas of a part
            worker = workers[stage]
            if zero == 3:
                assert isinstance(worker.shards, FullyShardedPart), "build the stage sharded (shard_replica)"
                self.fully_sharded[part] = worker.shards
            else:
                assert isinstance(worker.optimizer, ZeroOptimizer), "build the stage sharded (shard_replica)"
        self._left: dict[int, int] = {}
        self._pending: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # part -> (work, bucket) until combined
        self.peak_gradient_bytes = 0
        """The most gradient bytes (the parameters' whole gradients, ZeRO's slices) this rank held between its
        actions: after each compute action of the first step, and at every ``U``'s combine."""
        self._steps = 0

    def _spans(self, part: int, expert_groups: dict[int, Any]) -> list[tuple[Sequence[int], Any]]:
        params = list(self.workers[self.local[part][0]].module.parameters())  # ``gradients()``'s order
        if part not in expert_groups:
            return [(span, self.groups.get(part)) for span in _buckets(params, self.bucket_bytes)]
        spans: list[tuple[Sequence[int], Any]] = []
        for expert, group in ((False, self.groups.get(part)), (True, expert_groups[part])):
            kind = [i for i, p in enumerate(params) if is_expert(p) == expert]
            buckets = _buckets([params[i] for i in kind], self.bucket_bytes)
            spans += [([kind[i] for i in span], group) for span in buckets]
        return spans

    def begin_step(self) -> None:
        self._steps += 1
        self._left = dict(self.grad_actions)
        self._pending.clear()
        for part in sorted(self._left):
            if (
                self._left[part] == 0 and part not in self.at_update
            ):  # replicas that saw no microbatch contribute their zeros at once
                self._launch(part)

    def after(self, a: Action) -> None:
        """Call after every compute action: launches a part's reduction once its gradients are complete here."""
        part = self.placement.stage_part[a.stage]
        if part in self._left and a.op.computes_weight_grad:
            self._left[part] -= 1
            if part in self.per_action or (self._left[part] == 0 and part not in self.at_update):
                self._launch(part)
        if self._steps == 1 and self.local:  # measured in the first step, as the activations are
            self.peak_gradient_bytes = max(self.peak_gradient_bytes, self._held_bytes())

    def _launch(self, part: int) -> None:
        if part in self.fully_sharded:
            self.fully_sharded[part].reduce()
            return
        if part in self.per_action:
            self._settle(part)  # the part's previous reduce-scatter, added into the slices stepped
        grads = [w.gradients() for w in (self.workers[s] for s in self.local[part])]
        params = list(self.workers[self.local[part][0]].module.parameters())
        buckets = []
        for span, group in self.spans[part]:
            flat = _flatten([grads[0][i] for i in span])
            for other in grads[1:]:  # local replicas first, in stage order
                flat += _flatten([other[i] for i in span])
            if part in self.per_action:  # ZeRO-2: the whole gradients go as soon as the bucket holds them
                for i in span:
                    params[i].grad = None
            if part in self.sharded:  # ZeRO: this rank's slice of the sum only
                flat = pad(flat, dist.get_world_size(group))
                mine = flat.new_empty(flat.numel() // dist.get_world_size(group))
                buckets.append((dist.reduce_scatter_single(mine, flat, group=group, async_op=True), mine))
                continue
            work = None if group is None else dist.all_reduce(flat, group=group, async_op=True)
            buckets.append((work, flat))
        self._pending[part] = buckets

    def _combine(self, worker: StageWorker) -> None:
        stage = next(s for s, w in self.workers.items() if w is worker)
        part = self.placement.stage_part[stage]
        if part in self.fully_sharded:
            self.fully_sharded[part].finish()
            return
        if part in self.at_update:
            self._launch(part)
        buckets = self._pending.pop(part, None)
        if buckets is None:  # combined already this step (another local replica's U)
            return
        if part in self.sharded:
            for work, _ in buckets:
                work.wait()
            optimizer = cast(ZeroOptimizer, worker.optimizer)
            if part in self.per_action:
                optimizer.accumulate_gradients([mine for _, mine in buckets])
            else:
                optimizer.set_gradients([mine for _, mine in buckets])
        else:
            grads = [self.workers[s].gradients() for s in self.local[part]]
            for (span, _), (work, flat) in zip(self.spans[part], buckets):
                if work is not None:
                    work.wait()
                for replica in grads:
                    _unflatten(flat, [replica[i] for i in span])
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, self._held_bytes())

    def _settle(self, part: int) -> None:
        """ZeRO-2: wait for the part's pending reduce-scatter and add its slices into the optimizer's."""
        buckets = self._pending.pop(part, [])
        for work, _ in buckets:
            work.wait()
        if buckets:
            worker = self.workers[self.local[part][0]]
            cast(ZeroOptimizer, worker.optimizer).accumulate_gradients([mine for _, mine in buckets])

    def _held_bytes(self) -> int:
        """Gradient bytes this rank holds now: the parameters' whole gradients and ZeRO's slices."""
        held = 0
        for worker in self.workers.values():
            held += sum(
                p.grad.numel() * p.grad.element_size() for p in worker.module.parameters() if p.grad is not None
            )
            if isinstance(worker.optimizer, ZeroOptimizer):
                held += worker.optimizer.gradient_bytes()
        return held


def shard_replica(stage: Stage, zero: int, group: Any, dp_mesh: Any, bucket_bytes: int) -> None:
    """A build step of a data-parallel replica's stage: ZeRO-1 or 2, its optimizer state sharded over the replicas'
    ``group`` (``zero.ZeroOptimizer`` over the buckets ``ReplicaReduction`` reduce-scatters), or ZeRO-3, its
    layers fully sharded over ``dp_mesh`` (``fsdp.shard_stage``)."""
    if zero == 3:
        shard_stage(stage, dp_mesh)
        return
    params = list(stage.module.parameters())
    stage.optimizer = ZeroOptimizer(stage.optimizer_factory, params, _buckets(params, bucket_bytes), group)


def all_reduce_gradients(worker: StageWorker, group: Any, average: bool = False) -> None:
    """Sum ``worker``'s gradients over ``group`` in place (an asynchronous schedule's data-parallel replicas, at
    each ``U``: blocking, not bucketed -- a replica's update waits for its peers' gradients of the same group).

    ``average``: divide the sum by the group's size, as DDP does (PipeDream's replicated stages, 1F1B-RR: each
    replica's gradient is one whole microbatch's, ``schedule.round_robin``)."""
    grads = worker.gradients()
    flat = _flatten(grads)
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    _unflatten(flat, grads)


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int) -> list[range]:
    """Consecutive runs of ``grads`` of about ``bucket_bytes`` each (a larger tensor is a bucket of its own)."""
    spans, start, size = [], 0, 0
    for i, g in enumerate(grads):
        size += g.numel() * 4
        if size >= bucket_bytes:
            spans.append(range(start, i + 1))
            start, size = i + 1, 0
    if start < len(grads):
        spans.append(range(start, len(grads)))
    return spans


def _flatten(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).float() for g in grads])


def _unflatten(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
