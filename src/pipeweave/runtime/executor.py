"""The per-rank interpreter of a lowered schedule: one small method per op.

Each rank walks its lowered action list (``pipeweave.schedule.lower``) and
dispatches every action through ``Executor.dispatch``, a dict from ``Op`` to a
method, in the spirit of DeepSpeed's ``_INSTRUCTION_MAP``. Tensors between
stages on the same rank are handed over in memory; between ranks they travel
through ``P2P`` (``isend``/``irecv`` in one per-pair order, receives posted ahead). The first
stage of a pipeline takes the microbatch's data, the last computes its loss.

Replicated parts (Chimera, GEMS, DualPipe: ``Placement.replicas``): as soon as
a replica's last weight gradient of the step is done, its flattened gradient
is sent to the ranks of the other replicas (through ``P2P``, in its order); at ``U`` each replica sums every
replica's gradient in stage order, so all replicas apply bitwise the same
update (the validator's dataflow makes ``U`` wait for exactly these).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch

from pipeweave.errors import StuckError
from pipeweave.models.boundary import Boundary
from pipeweave.runtime.nonfinite import LossAgreement
from pipeweave.runtime.transport.order import replica_peers
from pipeweave.runtime.transport.p2p import P2P
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.stage.policy import RankPolicy
from pipeweave.runtime.stage.tied import TiedGradients
from pipeweave.schedule.grid import format_rows
from pipeweave.schedule.ir import Action, Op
from pipeweave.schedule.lower import LoweredSchedule

Record = tuple[Action, int, int]  # action, start and end in perf_counter_ns


class ReplicaGradients:
    """Sums the gradients of a part's replicas across ranks before ``U``.

    Messages go through the rank's ``P2P``, at the places ``comm.rank_sends``
    gives them, so both ends post them in one order (as NCCL needs).

    Args:
        lowered: the lowered schedule.
        rank: this rank.
        workers: this rank's stage workers.
        p2p: this rank's transport.
    """

    def __init__(self, lowered: LoweredSchedule, rank: int, workers: dict[int, StageWorker], p2p: P2P) -> None:
        placement = lowered.schedule.placement
        self.placement, self.rank, self.workers, self.p2p, self.lowered = placement, rank, workers, p2p, lowered
        self.replicated = {s for s in workers if len(placement.replicas(s)) > 1}
        # Per local replicated stage, how many B/W of a step complete its gradient.
        self.grad_actions = {s: 0 for s in self.replicated}
        for a in lowered.schedule.actions[rank]:
            if a.stage in self.replicated and a.op.computes_weight_grad:
                self.grad_actions[a.stage] += 1
        self._left: dict[int, int] = {}
        self._combined: set[int] = set()  # parts combined this step
        for s in self.replicated:
            workers[s].combine_grads = self._combine
            numel = sum(p.numel() for p in workers[s].module.parameters())
            for other in placement.replicas(s):
                if other not in workers:  # a remote replica of the same part: same size
                    p2p.grad_numel[other] = numel

    def begin_step(self) -> None:
        self._left = dict(self.grad_actions)
        self._combined.clear()
        for s in sorted(self._left):
            if self._left[s] == 0:  # a replica that saw no microbatch still sends its zeros
                self._send(s)

    def after(self, a: Action) -> None:
        """Call after every compute action: sends a replica's gradient once it is complete."""
        if a.stage in self._left and a.op.computes_weight_grad:
            self._left[a.stage] -= 1
            if self._left[a.stage] == 0:
                self._send(a.stage)

    def end_step(self) -> None:
        """Nothing left: the sends are waited with the transport's (``P2P.end_step``)."""

    def _send(self, s: int) -> None:
        flat = _flatten(self.workers[s].gradients())
        for peer in replica_peers(self.lowered, self.rank, s):
            self.p2p.send_gradient(s, peer, flat)

    def _combine(self, worker: StageWorker) -> None:
        stage = next(s for s, w in self.workers.items() if w is worker)
        part = self.placement.stage_part[stage]
        if part in self._combined:
            return
        self._combined.add(part)
        replicas = self.placement.replicas(stage)
        flats = []
        for other in replicas:  # stage order on every rank: bitwise equal sums
            if other in self.workers:
                flats.append(_flatten(self.workers[other].gradients()))
            else:
                flats.append(self.p2p.recv_gradient(other, self.placement.stage_rank[other]))
        total = flats[0].clone()
        for flat in flats[1:]:
            total += flat
        for other in replicas:
            if other in self.workers:
                _unflatten(total, self.workers[other].gradients())


def _flatten(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).float() for g in grads])


def _unflatten(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class Executor:
    """Runs one rank's lowered action list, one step at a time.

    Args:
        lowered: the lowered schedule.
        rank: this rank.
        workers: a ``StageWorker`` per stage placed on this rank.
        microbatch_sizes: dimension 0 of every microbatch (for the shape handshake).
        device: where tensors live.
        evaluate: run a forward-only schedule (``schedule.evaluation``) for evaluation: F runs as
            ``StageWorker.evaluate`` and the workers' gradient exchanges are left to the training executor.
        policy: an asynchronous schedule's weight policy (``stage.policy.RankPolicy``), called around
            every compute action (the weights each reads); None for synchronous schedules.
        combine_replicas: sum the gradients of a part's replicas before ``U``; False where replicas
            train apart (AvgPipe's, averaged by its policy instead).
        on_nonfinite: a synchronous run's ``TrainConfig.on_nonfinite``: every rank learns each step's
            loss (``nonfinite.LossAgreement``, ``step_loss``); ``skip``: no stage updates on a non-finite
            one. None: nothing agreed (evaluation, streams).

    Example:
        ex = Executor(lower(schedule), rank, workers, sizes, torch.device("cpu"))
        loss_part, records = ex.run_step(inputs, targets)
    """

    def __init__(
        self,
        lowered: LoweredSchedule,
        rank: int,
        workers: dict[int, StageWorker],
        microbatch_sizes: Sequence[int],
        device: torch.device,
        *,
        evaluate: bool = False,
        policy: RankPolicy | None = None,
        combine_replicas: bool = True,
        on_nonfinite: str | None = None,
    ) -> None:
        self.lowered, self.rank, self.workers, self.device = lowered, rank, workers, device
        self.placement = lowered.schedule.placement
        self.row = lowered.actions[rank]
        self.p2p = P2P(lowered, rank, microbatch_sizes, device)
        self.evaluating = evaluate
        """F runs as ``StageWorker.evaluate``; no gradient is prepared or exchanged."""
        exchanging = {} if evaluate else workers  # the training executor owns the workers' combine_grads
        self.replicas = ReplicaGradients(lowered, rank, exchanging if combine_replicas else {}, self.p2p)
        self.tied = TiedGradients(self.placement, exchanging, rank, self.p2p.tag_limit)
        if not evaluate and any(getattr(w.spec, "tie_embeddings", False) for w in workers.values()):
            # Every pipeline's first and last stage hold the two ends (runtime.stage.tied), on any rank.
            for line in self.placement.pipelines:
                if line[0] != line[-1]:
                    self.p2p.tied.update({line[0]: line[-1], line[-1]: line[0]})
        self.dispatch: dict[Op, Callable[[Action], None]] = {
            Op.F: self.forward,
            Op.B: self.backward,
            Op.I: self.backward_input,
            Op.W: self.backward_weight,
            Op.U: self.update,
            Op.SEND_F: self.send_forward,
            Op.RECV_F: self.recv_forward,
            Op.SEND_B: self.send_backward,
            Op.RECV_B: self.recv_backward,
        }
        self.peak_activation_bytes = 0
        # Of the last step: thread CPU ns per action (parallel to the records), process CPU ns of the step.
        self.action_cpu_ns: list[int] = []
        self.step_cpu_ns = 0
        # Per-step state: what flows between actions, keyed by (stage, microbatch).
        self._inputs: dict[tuple[int, int], Boundary] = {}
        self._outputs: dict[tuple[int, int], Boundary] = {}
        self._grads_in: dict[tuple[int, int], Boundary] = {}
        self._grads_out: dict[tuple[int, int], Boundary] = {}
        self._data: Sequence[Boundary] = ()
        self._targets: Sequence[Boundary] = ()
        self._losses: list[torch.Tensor] = []
        # Asynchronous schedules: the policy, and every microbatch's loss, for per-mini-batch losses.
        self.policy = policy
        self.losses_by_microbatch: dict[int, torch.Tensor] = {}
        self._prepared = False  # gradients zero-filled in this step (``_before_waiting``)
        self.agreement = None if on_nonfinite is None else LossAgreement(self.row, self.placement, device)
        self.skip_nonfinite = on_nonfinite == "skip"
        self.step_loss: float | None = None
        """Of the last step, with ``on_nonfinite``: its loss, every rank's share summed (the same on every rank)."""

    def run_step(self, data: Sequence[Boundary], targets: Sequence[Boundary]) -> tuple[float, list[Record]]:
        """Run the rank's actions once: returns this rank's share of the loss and the timings.

        ``data[j]`` is microbatch j's input (used by first stages), ``targets[j]``
        its target (used by last stages). The loss share is the sum of the
        scaled microbatch losses computed here; summed over ranks it is the
        mini-batch mean loss.
        """
        self._data, self._targets, self._losses = data, targets, []
        self._prepared = False
        self.p2p.begin_step()
        self.replicas.begin_step()
        if self.agreement is not None:
            self.agreement.begin_step()
        records: list[Record] = []
        # CPU time beside wall time: robust to other processes sharing the cores.
        self.action_cpu_ns = cpu_ns = []
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        step_cpu = time.process_time_ns()
        for i, a in enumerate(self.row):
            self.p2p.post_ahead(i)
            c0, t0 = cpu(), clock()
            self._run_or_explain(i, a)
            records.append((a, t0, clock()))
            cpu_ns.append(cpu() - c0)
        self.p2p.end_step()
        self.replicas.end_step()
        self.step_cpu_ns = time.process_time_ns() - step_cpu
        if self._inputs or self._outputs or self._grads_in or self._grads_out:  # pragma: no cover
            raise RuntimeError(f"rank {self.rank}: tensors left over at the end of a step")
        loss = float(torch.stack(self._losses).sum()) if self._losses else 0.0
        self.step_loss = None if self.agreement is None else self.agreement.total()
        return loss, records

    def _run_or_explain(self, i: int, a: Action) -> None:
        """Run action ``i`` of the row; a receive that fails (its peer timed out or died) is this rank stuck there."""
        if not a.op.is_recv:
            self._run(a)
            return
        try:
            self._run(a)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StuckError(f"rank {self.rank} stuck at its action {i} ({a}): {first}",
                             format_rows(self.lowered.actions, [(self.rank, i)])) from exc

    def _run(self, a: Action) -> None:
        handler = self.dispatch.get(a.op)
        if handler is None:
            raise ValueError(f"Unknown op {a.op!r} in action {a} on rank {self.rank}")
        worker = self.workers.get(a.stage)
        if worker is None or a.op.is_comm:
            handler(a)
            return
        track = worker.track_memory  # off after the first step unless asked (StageWorker.track_memory)
        if track:  # per-rank peak: the other stages' held bytes are constant during this action
            others = sum(w.activation_bytes() for s, w in self.workers.items() if s != a.stage)
            worker.reset_peak()
        if self.policy is not None:
            self.policy.enter(a)
        handler(a)
        if self.policy is not None:
            self.policy.exit(a)
        self.replicas.after(a)
        if track:
            self.peak_activation_bytes = max(self.peak_activation_bytes, others + worker.peak_activation_bytes())

    # ---- compute -----------------------------------------------------------
    def forward(self, a: Action) -> None:
        s, _, j = a
        prev = self.placement.prev_stage(s)
        x = self._data[j] if prev is None else self._inputs.pop((s, j))
        nxt = self.placement.next_stage(s)
        target = self._targets[j] if nxt is None else None
        worker = self.workers[s]
        out = worker.evaluate(x, target) if self.evaluating else worker.forward(j, x, target=target)
        if nxt is None:
            loss = cast(torch.Tensor, out)  # the last stage returns its scaled loss
            self._losses.append(loss)  # summed at the end of the step: no sync per microbatch
            if self.agreement is not None:
                self.agreement.loss_added(self._losses)
            if self.policy is not None:
                self.losses_by_microbatch[j] = loss
        elif self.placement.stage_rank[nxt] == self.rank:
            self._inputs[(nxt, j)] = out  # a neighbour on this rank: no message
        else:
            self._outputs[(s, j)] = out

    def backward(self, a: Action) -> None:
        self._backward(a, self.workers[a.stage].backward)

    def backward_input(self, a: Action) -> None:
        self._backward(a, self.workers[a.stage].backward_input)

    def _backward(self, a: Action, run: Callable[[int, Boundary | None], Boundary | None]) -> None:
        s, _, j = a
        nxt = self.placement.next_stage(s)
        grad_output = None if nxt is None else self._grads_in.pop((s, j))
        grad_input = run(j, grad_output)
        prev = self.placement.prev_stage(s)
        if prev is None:
            return
        assert grad_input is not None, f"{a}: stage input has no gradient"
        if self.placement.stage_rank[prev] == self.rank:
            self._grads_in[(prev, j)] = grad_input
        else:
            self._grads_out[(s, j)] = grad_input

    def backward_weight(self, a: Action) -> None:
        self.workers[a.stage].backward_weight(a.microbatch)

    def update(self, a: Action) -> None:
        self.p2p.before_update(a.stage)  # a tied exchange takes its place in the per-pair order
        skip = self.skip_nonfinite and not math.isfinite(cast(LossAgreement, self.agreement).total())
        self.workers[a.stage].update(skip=skip)

    # ---- communication -----------------------------------------------------
    def send_forward(self, a: Action) -> None:
        self.p2p.send(a, self._outputs.pop((a.stage, a.microbatch)))

    def recv_forward(self, a: Action) -> None:
        self._before_waiting(a)
        self._inputs[(a.stage, a.microbatch)] = self.p2p.recv(a)

    def send_backward(self, a: Action) -> None:
        self.p2p.send(a, self._grads_out.pop((a.stage, a.microbatch)))

    def recv_backward(self, a: Action) -> None:
        self._before_waiting(a)
        self._grads_in[(a.stage, a.microbatch)] = self.p2p.recv(a)

    def _before_waiting(self, a: Action) -> None:
        """Use a wait for a message (part of the bubble) to zero-fill the gradients the step will accumulate.

        Synchronous schedules only: an asynchronous policy updates per
        microbatch and keeps gradients its own way.
        """
        if self.policy is None and not self.evaluating and not self._prepared and not self.p2p.arrived(a):
            self._prepared = True
            for worker in self.workers.values():
                worker.prepare_gradients()
