"""The in-process walk of a schedule: every stage in one process, each rank's actions in order.

It walks the ranks round-robin, each running its action list in order as far
as the data dependencies of the IR allow (the same rules as
``pipeweave.schedule.dataflow``), with one ``StageWorker`` per stage and the
tensors passed between stages in memory. ``runtime.reference`` runs training
on it (synchronous steps and asynchronous streams); a stuck walk is an error
that prints the schedule's grid with each rank's next action marked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch

from pipeweave.errors import StuckError, UserError
from pipeweave.models.boundary import Boundary
from pipeweave.models.spec import ModelSpec, uniform_parts
from pipeweave.runtime.stage.tied import tie_peer, tie_peer_parts
from pipeweave.runtime.stage.worker import Combine, OptimizerFactory, StageWorker
from pipeweave.schedule.grid import format_rows
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.sim.recompute import Recompute, per_part


def build_workers(
    schedule: Schedule,
    spec: ModelSpec,
    *,
    batch_size: int,
    optimizer_factory: OptimizerFactory | None = None,
    recompute: Recompute = False,
    parts: list[range] | None = None,
    precision: str = "fp32",
) -> list[StageWorker]:
    """One worker per stage of ``schedule``; part k gets ``parts[k]`` (default: uniform) and its own
    recomputation (``recompute``: one mode for every part or one per part, ``sim.recompute``)."""
    if precision == "fp16":  # its gradients would underflow: loss scaling is the distributed run's
        raise UserError(
            "the reference executor has no loss scaling for --precision fp16; give bf16 or fp32, or train fp16 "
            "with pipeweave train (runtime.loss_scale)"
        )
    parts = parts if parts is not None else uniform_parts(spec.num_layers, schedule.num_parts)
    if len(parts) != schedule.num_parts:
        raise UserError(f"{len(parts)} layer ranges given for {schedule.num_parts} parts; give one per part")
    modes = per_part(recompute, schedule.num_parts)
    return [
        StageWorker(
            spec,
            parts[part],
            batch_size=batch_size,
            optimizer_factory=optimizer_factory,
            recompute=modes[part],
            precision=precision,
        )
        for part in schedule.placement.stage_part
    ]


def sum_replica_gradients(replicas: list[StageWorker]) -> None:
    """Set every replica's gradients to the sum over the replicas (what an all-reduce would give)."""
    if len(replicas) < 2:
        return
    grads = [w.gradients() for w in replicas]
    for tensors in zip(*grads):
        total = torch.stack(tensors).sum(0)
        for t in tensors:
            t.copy_(total)


class Walk:
    """The state of one step's walk: tensors in flight between stages and what has run."""

    def __init__(
        self,
        schedule: Schedule,
        workers: list[StageWorker],
        inputs: Sequence[Boundary],
        targets: Sequence[Boundary],
        combine: Mapping[int, Combine] | None = None,
    ) -> None:
        self.schedule, self.workers = schedule, workers
        self.combine = combine or {}  # per stage, what its U runs after the replicas' sum (the ties')
        self.inputs, self.targets = inputs, targets
        self.outputs: dict[tuple[int, int], Boundary] = {}  # (stage, mb) -> its output, until consumed
        self.grads: dict[tuple[int, int], Boundary] = {}  # (stage, mb) -> its input gradient
        self.forwarded: set[tuple[int, int]] = set()
        self.input_done: set[tuple[int, int]] = set()
        self.losses: dict[int, float] = {}
        self.remaining = _weight_grad_counts(schedule)  # part -> B/W still to run
        self.combined: set[int] = set()

    def ready(self, a: Action) -> bool:
        placement = self.schedule.placement
        s, op, j = a
        if op is Op.F:
            prev = placement.prev_stage(s)
            return prev is None or (prev, j) in self.outputs
        if op.computes_input_grad:
            nxt = placement.next_stage(s)
            return (s, j) in self.forwarded and (nxt is None or (nxt, j) in self.grads)
        if op is Op.W:
            return (s, j) in self.input_done
        if op is Op.U:  # its part's gradients, and those of a tied peer's part (runtime.stage.tied)
            parts = (placement.stage_part[s], *tie_peer_parts(placement, s, self.workers[s]))
            return all(self.remaining.get(p, 0) == 0 for p in parts)
        raise ValueError(f"unknown op in action {a}")

    def run(self, a: Action) -> None:
        placement = self.schedule.placement
        s, op, j = a
        worker = self.workers[s]
        prev, nxt = placement.prev_stage(s), placement.next_stage(s)
        if op is Op.F:
            x = self.inputs[j] if prev is None else self.outputs.pop((prev, j))
            out = worker.forward(j, x, self.targets[j] if nxt is None else None)
            if nxt is None:
                self.losses[j] = self.losses.get(j, 0.0) + cast(torch.Tensor, out).item()
            else:
                self.outputs[(s, j)] = out
                aux = worker.take_aux_loss()  # an MoE stage's share of the objective (models.moe)
                if aux is not None:
                    self.losses[j] = self.losses.get(j, 0.0) + aux.item()
            self.forwarded.add((s, j))
        elif op.computes_input_grad:
            grad_output = None if nxt is None else self.grads.pop((nxt, j))
            backward = worker.backward if op is Op.B else worker.backward_input
            grad_input = backward(j, grad_output)
            if prev is not None:
                assert grad_input is not None
                self.grads[(s, j)] = grad_input
            if op is Op.I:
                self.input_done.add((s, j))
        elif op is Op.W:
            worker.backward_weight(j)
        else:
            self._update(s)
        if op.computes_weight_grad:
            self.remaining[placement.stage_part[s]] -= 1

    def _update(self, stage: int) -> None:
        placement = self.schedule.placement
        peer = tie_peer(placement, stage, self.workers[stage])
        # Combine once per part, before its first U of the step. A tied U also reads its peer's
        # gradients (runtime.stage.tied): that part's replicas are combined first too, as every rank of
        # the distributed executor does before its exchange; else a replicated tie sums partial ones.
        for s in (stage,) if peer is None else (stage, peer):
            if placement.stage_part[s] not in self.combined:
                sum_replica_gradients([self.workers[r] for r in placement.replicas(s)])
                self.combined.add(placement.stage_part[s])
        self.workers[stage].update(combine=self.combine.get(stage))


def _weight_grad_counts(schedule: Schedule) -> dict[int, int]:
    counts: dict[int, int] = {}
    for row in schedule.actions:
        for s, op, _ in row:
            if op.computes_weight_grad:
                part = schedule.placement.stage_part[s]
                counts[part] = counts.get(part, 0) + 1
    return counts


def run_step(
    schedule: Schedule,
    workers: list[StageWorker],
    inputs: Sequence[Boundary],
    targets: Sequence[Boundary],
    state: Walk | None = None,
    combine: Mapping[int, Combine] | None = None,
) -> float:
    """Run one step of a synchronous schedule; returns the mini-batch mean loss.

    ``state`` replaces the walk's state (``runtime.reference`` walks an asynchronous stream with its own);
    ``combine``: per stage, what its ``U`` runs after the replicas' sum (``TiedGradients.hooks``).

    Raises:
        StuckError: the schedule gets stuck (no rank can run its next action); its message ends with the
            schedule's grid, every rank's next action in brackets.
    """
    state = state if state is not None else Walk(schedule, workers, inputs, targets, combine)
    ptr = [0] * schedule.num_ranks
    while any(ptr[r] < len(row) for r, row in enumerate(schedule.actions)):
        progressed = False
        for r, row in enumerate(schedule.actions):
            while ptr[r] < len(row) and state.ready(row[ptr[r]]):
                state.run(row[ptr[r]])
                ptr[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(row[ptr[r]]) for r, row in enumerate(schedule.actions) if ptr[r] < len(row)}
            marks = [(r, ptr[r]) for r in stuck]
            raise StuckError(
                f"schedule {schedule.name} is stuck; next actions per rank: {stuck}",
                format_rows(schedule.actions, marks),
            )
    # Summed in microbatch order, as plain training sums them.
    return sum(state.losses[j] for j in sorted(state.losses))


def trained_parameters(
    workers: Sequence[StageWorker],
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Copies of the workers' parameters: by name (a replicated part's first replica) and per stage."""
    stage_parameters = [{k: p.detach().clone() for k, p in w.named_parameters().items()} for w in workers]
    parameters: dict[str, torch.Tensor] = {}
    for params in stage_parameters:
        for k, p in params.items():
            parameters.setdefault(k, p)
    return parameters, stage_parameters
