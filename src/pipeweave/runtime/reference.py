"""The reference executor: any schedule, every stage in one process, deterministically (streams: ``runtime.stream``).

It walks the ranks round-robin, each running its action list in order as far
as the data dependencies of the IR allow (the same rules as
``pipeweave.schedule.dataflow``), with one ``StageWorker`` per stage and the
tensors passed between stages in memory. It is the oracle of the distributed
executor's tests and a fast path for convergence studies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from pipeweave.data import DataSource, data_source, split_microbatches
from pipeweave.errors import UserError
from pipeweave.models.boundary import Boundary
from pipeweave.models.spec import ModelSpec, uniform_parts
from pipeweave.runtime.lr_schedule import set_lr
from pipeweave.runtime.plain import TrainResult
from pipeweave.runtime.stage import OptimizerFactory, StageWorker
from pipeweave.runtime.tied import TiedGradients, tie_peer, tie_peer_parts
from pipeweave.schedule.ir import Action, Op, Schedule


def build_workers(
    schedule: Schedule,
    spec: ModelSpec,
    *,
    batch_size: int,
    optimizer_factory: OptimizerFactory | None = None,
    recompute: bool = False,
    parts: list[range] | None = None,
    precision: str = "fp32",
) -> list[StageWorker]:
    """One worker per stage of ``schedule``; part k gets ``parts[k]`` (default: uniform)."""
    parts = parts if parts is not None else uniform_parts(spec.num_layers, schedule.num_parts)
    if len(parts) != schedule.num_parts:
        raise UserError(f"{len(parts)} layer ranges given for {schedule.num_parts} parts; give one per part")
    return [
        StageWorker(
            spec, parts[part], batch_size=batch_size, optimizer_factory=optimizer_factory, recompute=recompute,
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


class _Step:
    """The state of one step's walk: tensors in flight between stages and what has run."""

    def __init__(self, schedule: Schedule, workers: list[StageWorker], inputs: Sequence[Boundary],
                 targets: Sequence[Boundary]) -> None:
        self.schedule, self.workers = schedule, workers
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
        if op is Op.U:  # its part's gradients, and those of a tied peer's part (runtime.tied)
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
                self.losses[j] = cast(torch.Tensor, out).item()
            else:
                self.outputs[(s, j)] = out
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
        # gradients (runtime.tied): that part's replicas are combined first too, as every rank of
        # the distributed executor does before its exchange; else a replicated tie sums partial ones.
        for s in (stage,) if peer is None else (stage, peer):
            if placement.stage_part[s] not in self.combined:
                sum_replica_gradients([self.workers[r] for r in placement.replicas(s)])
                self.combined.add(placement.stage_part[s])
        self.workers[stage].update()


def _weight_grad_counts(schedule: Schedule) -> dict[int, int]:
    counts: dict[int, int] = {}
    for row in schedule.actions:
        for s, op, _ in row:
            if op.computes_weight_grad:
                part = schedule.placement.stage_part[s]
                counts[part] = counts.get(part, 0) + 1
    return counts


def run_step(schedule: Schedule, workers: list[StageWorker], inputs: Sequence[Boundary],
             targets: Sequence[Boundary], state: _Step | None = None) -> float:
    """Run one step of a synchronous schedule; returns the mini-batch mean loss.

    ``state`` replaces the walk's state (``runtime.stream`` walks an asynchronous stream with its own).

    Raises:
        RuntimeError: the schedule gets stuck (no rank can run its next action).
    """
    state = state if state is not None else _Step(schedule, workers, inputs, targets)
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
            raise RuntimeError(f"schedule {schedule.name} is stuck; next actions per rank: {stuck}")
    # Summed in microbatch order, as plain training sums them.
    return sum(state.losses[j] for j in sorted(state.losses))


def run_reference(
    schedule: Schedule,
    spec: ModelSpec,
    *,
    steps: int,
    batch_size: int,
    optimizer_factory: OptimizerFactory | None = None,
    seed: int = 0,
    recompute: bool = False,
    data: DataSource | None = None,
    parts: list[range] | None = None,
    precision: str = "fp32",
    lr_at: Callable[[int], float] | None = None,
) -> TrainResult:
    """Train with ``schedule`` for ``steps`` steps, every stage in this process.

    Args:
        schedule: a synchronous schedule (one step; it is repeated each step), or an
            asynchronous stream, run once (``steps`` = its mini-batches; default policy options).
        spec: the model.
        steps: optimizer steps.
        batch_size: samples per mini-batch, split into ``schedule.num_microbatches``.
        optimizer_factory: builds each stage's optimizer (default SGD, lr 0.1).
        seed: data seed.
        recompute: activation recomputation on every stage.
        data: a data source (default ``data_source(spec, ...)``).
        parts: layer range per part (default ``uniform_parts``).
        precision: ``fp32`` or ``bf16`` (``models.precision``).
        lr_at: the learning rate of step k (of a stream: of each stage's k-th update), ``LrSchedule.at``;
            None keeps the optimizers'.

    Raises:
        UserError: a stream of another length than ``steps``, more parts than layers, fewer samples than microbatches.

    Example:
        >>> from pipeweave.schedule import generate
        >>> spec = ModelSpec(kind="mlp", layers=2, hidden=8)
        >>> r = run_reference(generate("1f1b", num_stages=2, num_microbatches=2), spec, steps=2, batch_size=4)
        >>> len(r.losses), sorted(r.parameters)[0]
        (2, '0.down.bias')
    """
    if not schedule.is_synchronous:  # a stream: run once, its mini-batches are the steps (runtime.stream)
        from pipeweave.runtime.stream import run_stream_reference

        minibatches = schedule.num_steps * len(schedule.placement.pipelines)
        if steps != minibatches:
            raise UserError(f"the asynchronous {schedule.name} stream covers {minibatches} mini-batches, not steps={steps}; "
                            f"generate it with num_steps for {steps} mini-batches")
        return run_stream_reference(schedule, spec, batch_size=batch_size, optimizer_factory=optimizer_factory,
                                    seed=seed, recompute=recompute, data=data, parts=parts, precision=precision,
                                    lr_at=lr_at)
    workers = build_workers(
        schedule, spec, batch_size=batch_size, optimizer_factory=optimizer_factory, recompute=recompute, parts=parts,
        precision=precision,
    )
    TiedGradients(schedule.placement, dict(enumerate(workers)))  # hooks the tied stages' updates
    source = data if data is not None else data_source(spec, batch_size=batch_size, seed=seed)
    losses = []
    for step in range(steps):
        inputs, targets = source.batch(step)
        t = schedule.num_microbatches
        if lr_at is not None:
            for worker in workers:
                set_lr(worker.optimizer, lr_at(step))
        losses.append(run_step(schedule, workers, split_microbatches(inputs, t), split_microbatches(targets, t)))
    parameters, stage_parameters = trained_parameters(workers)
    peaks = [w.peak_activation_bytes() for w in workers]
    return TrainResult(losses, parameters, stage_parameters, peaks)


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
