"""The per-rank interpreter of a lowered schedule: one small method per op.

Each rank walks its lowered action list (``pipeweave.schedule.lower``) and
dispatches every action through ``Executor.dispatch``, a dict from ``Op`` to a
method, in the spirit of DeepSpeed's ``_INSTRUCTION_MAP``. Tensors between
stages on the same rank are handed over in memory; between ranks they travel
through ``P2P`` (``isend``/``irecv`` in one per-pair order, receives posted ahead). The first
stage of a pipeline takes the microbatch's data, the last computes its loss.

Replicated parts (data parallelism; Chimera, GEMS, DualPipe: ``Placement.replicas``):
as soon as a replica's last weight gradient of the step is done, its buckets
are all-reduced over the part's replica group (``runtime.replicas``), and its
``U`` waits for them, so all replicas apply bitwise the same update.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from pipeweave.errors import StuckError
from pipeweave.models.boundary import Boundary
from pipeweave.runtime.clip import GlobalNormClip
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.loss_scale import LossScale, LossScaling, check_row
from pipeweave.runtime.nonfinite import LossAgreement
from pipeweave.runtime.replicas import DEFAULT_BUCKET_BYTES, ReplicaReduction, all_reduce_gradients
from pipeweave.runtime.stage.levers import Packed, host_store, stash_away, stash_back
from pipeweave.runtime.stage.policy import RankPolicy
from pipeweave.runtime.stage.sequence_parallel import PartialGradients
from pipeweave.runtime.stage.tied import TiedGradients, tied_groups
from pipeweave.runtime.stage.tied_stream import StreamTies
from pipeweave.runtime.stage.worker import Combine, StageWorker
from pipeweave.runtime.transport.mesh import replica_rank_sets
from pipeweave.runtime.transport.p2p import P2P
from pipeweave.runtime.transport.partner import PartnerLink
from pipeweave.runtime.transport.timing import action_timer
from pipeweave.schedule.grid import format_rows
from pipeweave.schedule.ir import Action, Op
from pipeweave.schedule.lower import LoweredSchedule

Record = tuple[Action, int, int]  # action, start and end in perf_counter_ns (``transport.timing``)


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
        combine_replicas: sum the gradients of a part's replicas before ``U`` (over the groups of the
            run's mesh, ``context.mesh``, which must be there where replicas span ranks); False where
            replicas train apart (AvgPipe's, averaged by its policy instead).
        sum_over: a group whose processes sum each stage's gradients at every ``U`` before anything else
            (an asynchronous run's data-parallel replicas laid out around the stream: PipeDream's hybrid).
        average_over: a group whose processes average each stage's gradients at every ``U`` before anything
            else (the replicas of this rank's part in PipeDream's 1F1B-RR, ``schedule.round_robin``).
        bucket_bytes: the size of the buckets of that sum (``runtime.replicas``).
        zero: the ZeRO stage of data-parallel replicas (``runtime.zero``): 1 optimizer state sharded over
            them, 2 gradients too, 3 parameters too.
        clip_norm: clip the global gradient norm to this at every ``U`` (``runtime.clip``; None: no clipping).
        partner: this rank's side of BPipe's pair (``transport.partner``), for EVICT and LOAD.
        on_nonfinite: a synchronous run's ``TrainConfig.on_nonfinite``: every rank learns each step's
            loss (``nonfinite.LossAgreement``, ``step_loss``); ``skip``: no stage updates on a non-finite
            one. None: nothing agreed (evaluation, streams).
        variable_shapes: messages whose per-sample shape changes (sequences of variable length): each
            carries its own metadata (``transport.p2p``).
        context: this rank's run context (``runtime.context``): its mesh and groups, its transport, its waits.
        loss_scale: ``--precision fp16``'s scale (``runtime.loss_scale``): every loss's backward starts from it,
            the first ``U`` of each step agrees on an overflow with every rank, each ``U`` unscales (before
            clipping) and skips after an overflow. None: no loss scaling.

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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        zero: int = 0,
        clip_norm: float | None = None,
        partner: PartnerLink | None = None,
        variable_shapes: bool = False,
        context: RankContext | None = None,
        sum_over: Any = None,
        loss_scale: LossScale | None = None,
        average_over: Any = None,
    ) -> None:
        self.lowered, self.rank, self.workers, self.device = lowered, rank, workers, device
        self.context = context = context if context is not None else RankContext()
        self.placement = lowered.schedule.placement
        self.schedule = lowered.schedule
        self.row = lowered.actions[rank]
        self.scaling = None if loss_scale is None or evaluate else self._scaling(loss_scale, policy)
        self.p2p = P2P(lowered, rank, microbatch_sizes, device, variable_shapes=variable_shapes, context=context)
        self.evaluating = evaluate  # F runs as ``StageWorker.evaluate``; no gradient is prepared or exchanged
        self._exchanges(
            {} if evaluate else workers,
            policy is not None,
            combine_replicas,
            bucket_bytes,
            zero,
            clip_norm,
            (sum_over, average_over),
        )
        self.dispatch = self._dispatch_table()
        self.partner, self.store = partner, self._offload_store()
        self._measures(device)
        # Per-step state: what flows between actions, keyed by (stage, microbatch).
        self._inputs: dict[tuple[int, int], Boundary] = {}
        self._outputs: dict[tuple[int, int], Boundary] = {}
        self._grads_in: dict[tuple[int, int], Boundary] = {}
        self._grads_out: dict[tuple[int, int], Boundary] = {}
        self._data: Sequence[Boundary] = ()
        self._targets: Sequence[Boundary] = ()
        self._losses: list[torch.Tensor] = []
        self._aux_losses: list[torch.Tensor] = []  # MoE stages' other than the last (models.moe)
        # Asynchronous schedules: the policy, and every microbatch's loss, for per-mini-batch losses.
        self.policy = policy
        self.losses_by_microbatch: dict[int, torch.Tensor] = {}
        self._prepared = False  # gradients zero-filled in this step (``_before_waiting``)
        group = context.pipeline_group
        self.agreement = None if on_nonfinite is None else LossAgreement(self.row, self.placement, device, group)
        self.skip_nonfinite = on_nonfinite == "skip"
        self.step_loss: float | None = None
        """Of the last step, with ``on_nonfinite``: its loss, every rank's share summed (the same on every rank)."""

    def _measures(self, device: torch.device) -> None:
        """What the executor measures of each step."""
        self.peak_activation_bytes = 0
        # Of the last step: thread CPU ns per action (parallel to the records), process CPU ns of the step.
        self.action_cpu_ns: list[int] = []
        self.step_cpu_ns = 0
        self.timer = action_timer(device)
        """Marks each action's start and end: the host clock on the CPU, CUDA events on a GPU (``transport.timing``)."""
        self.step_memory: tuple[int, int] | None = None
        """Of the last step on CUDA: the allocator's peak allocated and reserved bytes (None on the CPU)."""

    def _scaling(self, scale: LossScale, policy: RankPolicy | None) -> LossScaling:
        """This rank's side of the run's loss scaling, where a step's updates can wait for its overflow check."""
        if policy is not None:
            raise RuntimeError("loss scaling skips a step's updates, and a stream's stages update per microbatch")
        check_row(self.row, self.rank)
        return LossScaling(scale, self.workers)

    def _dispatch_table(self) -> dict[Op, Callable[[Action], None]]:
        """The method that runs each op."""
        return {
            Op.F: self.forward,
            Op.B: self.backward,
            Op.I: self.backward_input,
            Op.W: self.backward_weight,
            Op.U: self.update,
            Op.SEND_F: self.send_forward,
            Op.RECV_F: self.recv_forward,
            Op.SEND_B: self.send_backward,
            Op.RECV_B: self.recv_backward,
            Op.OFFLOAD: self.offload,
            Op.RELOAD: self.reload,
            Op.EVICT: self.evict,
            Op.LOAD: self.load,
        }

    def _exchanges(
        self,
        exchanging: dict[int, StageWorker],
        stream: bool,
        combine_replicas: bool,
        bucket_bytes: int,
        zero: int,
        clip_norm: float | None,
        around: tuple[Any, Any],
    ) -> None:
        """The gradient exchanges of ``exchanging`` (the training executor's workers; none when evaluating):
        the replicas' sums, the ties', the clipping, and ``combine``, what each ``U`` runs of them."""
        self.replicas = ReplicaReduction(
            self.placement,
            self.row,
            exchanging if combine_replicas else {},
            _replica_groups(self.placement, self.context) if exchanging and combine_replicas else {},
            bucket_bytes,
            zero,
            self.context.mesh.expert_groups if self.context.mesh is not None else None,
        )
        self.tied = self._ties(exchanging, self.evaluating, stream)
        unclipped = clip_norm is None or self.evaluating
        self.clip = None if unclipped else GlobalNormClip(clip_norm, self.workers, self.context.mesh)
        self.combine = self._combines(exchanging, *around)
        """Per stage, what its ``U`` runs before the optimizer step (``StageWorker.update(combine=...)``)."""

    def _combines(self, exchanging: dict[int, StageWorker], sum_over: Any, average_over: Any) -> dict[int, Combine]:
        """Each stage's gradient exchanges, in order: a stream's replicas around it (``sum_over``) or of its part
        (``average_over``), the replicas' sum, sequence parallelism's partial sums over ``tp`` and context
        parallelism's over ``cp`` (sums over dp, tp and cp commute), the ties' (before all
        of them under ZeRO-1: a tie is summed whole, then sliced), the global norm's clipping (of what the
        optimizer applies)."""
        partial = PartialGradients(exchanging).hooks
        sequence = {  # context parallelism: each rank's gradients from its part of every sequence
            s: functools.partial(all_reduce_gradients, group=w.context_parallel.group)
            for s, w in exchanging.items()
            if w.context_parallel is not None
        }
        ties = self.tied.hooks
        first = isinstance(self.tied, TiedGradients) and self.tied.first
        clip = self.clip.hooks if self.clip is not None else {}
        unscale = self.scaling.hooks if self.scaling is not None else {}
        around = None if sum_over is None else functools.partial(all_reduce_gradients, group=sum_over)
        if average_over is not None:
            around = functools.partial(all_reduce_gradients, group=average_over, average=True)
        combine = {}
        for s in exchanging:
            steps = [
                ties.get(s) if first else None,
                around,
                self.replicas.hooks.get(s),
                partial.get(s),
                sequence.get(s),
                None if first else ties.get(s),
                unscale.get(s),
                clip.get(s),
            ]
            combine[s] = chain([step for step in steps if step is not None])
        return combine

    def _ties(self, exchanging: dict[int, StageWorker], evaluate: bool, stream: bool) -> TiedGradients | StreamTies:
        """The tied gradients' sum: every pipeline's first and last stage exchange their ties, on any rank
        (``runtime.stage.tied``; a stream's by its own rule, ``runtime.stage.tied_stream``)."""
        tied: TiedGradients | StreamTies
        if stream:
            tied = StreamTies(self.lowered.schedule, exchanging, self.p2p)
            self.p2p.tied_message = tied.message()
        else:
            tied = TiedGradients(
                self.placement,
                exchanging,
                self.rank,
                self.p2p.tag_limit,
                first=bool(self.replicas.at_update),
                context=self.context,
            )  # ZeRO-1: whole first
        if not evaluate and any(tied_groups(w.spec) for w in self.workers.values()):
            for line in self.placement.pipelines:
                if line[0] != line[-1]:
                    self.p2p.tied.update({line[0]: line[-1], line[-1]: line[0]})
        return tied

    def run_step(self, data: Sequence[Boundary], targets: Sequence[Boundary]) -> tuple[float, list[Record]]:
        """Run the rank's actions once: returns this rank's share of the loss and the timings.

        ``data[j]`` is microbatch j's input (used by first stages), ``targets[j]``
        its target (used by last stages). The loss share is the sum of the
        scaled microbatch losses computed here; summed over ranks it is the
        mini-batch mean loss.
        """
        self._data, self._targets, self._losses, self._aux_losses = data, targets, [], []
        self._prepared = False
        self.p2p.begin_step()
        self.replicas.begin_step()
        if self.scaling is not None:
            self.scaling.begin_step()
        if self.agreement is not None:
            self.agreement.begin_step()
        marks: list[Any] = []  # each action's start and end (``transport.timing``), resolved after the step
        # CPU time beside wall time: robust to other processes sharing the cores.
        self.action_cpu_ns = cpu_ns = []
        timer, cpu = self.timer, time.thread_time_ns
        timer.begin_step()
        step_cpu = time.process_time_ns()
        for i, a in enumerate(self.row):
            self.p2p.post_ahead(i)
            if a.op.is_compute:
                self.p2p.flush()  # the messages of the gap before this action go out as one group
            if self.store is not None and i + 1 < len(self.row) and self.row[i + 1].op is Op.RELOAD:
                self.store.prefetch(self.row[i + 1][::2])  # CUDA: its copy runs beside action i
            c0 = cpu()
            marks.append(timer.mark())
            self._run_or_explain(i, a)
            marks.append(timer.mark())
            cpu_ns.append(cpu() - c0)
        if isinstance(self.tied, StreamTies):
            self.tied.drain()  # the last ends' owed tied update, before the stream's last messages are waited
        self.p2p.end_step()
        self.step_cpu_ns = time.process_time_ns() - step_cpu
        times = timer.resolve(marks)  # CUDA: the step's one synchronisation
        records: list[Record] = [(a, times[2 * i], times[2 * i + 1]) for i, a in enumerate(self.row)]
        self.step_memory = timer.step_memory()
        if self._inputs or self._outputs or self._grads_in or self._grads_out:  # pragma: no cover
            raise RuntimeError(f"rank {self.rank}: tensors left over at the end of a step")
        shares = self._losses + self._aux_losses
        loss = float(torch.stack(shares).sum()) if shares else 0.0
        self.step_loss = None if self.agreement is None else self.agreement.total()
        return loss, records

    @property
    def overflowed(self) -> bool:
        """Whether the last step's fp16 gradients overflowed on some rank, its updates skipped (``loss_scale``)."""
        return self.scaling is not None and bool(self.scaling.overflowed[-1:] == [True])

    def _run_or_explain(self, i: int, a: Action) -> None:
        """Run action ``i`` of the row; a receive that fails (its peer timed out or died) is this rank stuck there."""
        if not a.op.is_recv:
            self._run(a)
            return
        try:
            self._run(a)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StuckError(
                f"rank {self.rank} stuck at its action {i} ({a}): {first}",
                format_rows(self.lowered.actions, [(self.rank, i)]),
            ) from exc

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
            others += self.partner.lent if self.partner is not None else 0  # held for BPipe's owner
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
        prev = self.schedule.prev_of(s, j)
        x = self._data[j] if prev is None else self._inputs.pop((s, j))
        nxt = self.schedule.next_of(s, j)
        target = self._targets[j] if nxt is None else None
        worker = self.workers[s]
        out = worker.evaluate(x, target) if self.evaluating else worker.forward(j, x, target=target)
        if nxt is None:
            loss = cast(torch.Tensor, out)  # the last stage returns its scaled loss
            self._losses.append(loss)  # summed at the end of the step: no sync per microbatch
            if self.agreement is not None:
                self.agreement.loss_added(self._losses)
            if self.policy is not None:
                self.losses_by_microbatch[j] = self.losses_by_microbatch.get(j, 0) + loss
        else:
            self._aux_loss(j, worker.take_aux_loss())
            if self.placement.stage_rank[nxt] == self.rank:
                self._inputs[(nxt, j)] = out  # a neighbour on this rank: no message
            else:
                self._outputs[(s, j)] = out

    def _aux_loss(self, j: int, aux: torch.Tensor | None) -> None:
        """A stage's MoE auxiliary losses (``models.moe``), not the last: part of this rank's share of the loss."""
        if aux is None:
            return
        self._aux_losses.append(aux)
        if self.policy is not None:
            self.losses_by_microbatch[j] = self.losses_by_microbatch.get(j, 0) + aux

    def backward(self, a: Action) -> None:
        self._backward(a, self.workers[a.stage].backward)

    def backward_input(self, a: Action) -> None:
        self._backward(a, self.workers[a.stage].backward_input)

    def _backward(self, a: Action, run: Callable[[int, Boundary | None], Boundary | None]) -> None:
        s, _, j = a
        nxt = self.schedule.next_of(s, j)
        if nxt is not None:
            grad_output = self._grads_in.pop((s, j))
        else:  # the loss: from 1, or from the loss scale
            grad_output = None if self.scaling is None else self.scaling.root()
        grad_input = run(j, grad_output)
        prev = self.schedule.prev_of(s, j)
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
        if self.scaling is not None:
            skip = self.scaling.skip() or skip  # every rank's check, at the first U of the step
        self.workers[a.stage].update(skip=skip, combine=self.combine.get(a.stage))

    # ---- memory (schedule.levers) ---------------------------------------------
    def _offload_store(self) -> Any:
        """Where this rank offloads (``stage.levers.host_store``), None without OFFLOAD; the stages that move
        activations keep what autograd saves."""
        self._away: dict[tuple[int, int], Packed] = {}  # moved away: how to rebuild it
        self._kept: dict[tuple[int, int], int | None] = {}  # BPipe: the meter key of what an EVICT kept here
        for a in self.row:
            if a.op.is_memory and not self.workers[a.stage].stashing:
                raise RuntimeError(
                    f"rank {self.rank}: stage {a.stage} moves activations ({a}) but was not built "
                    "stashing them: build it with stashing=True (runtime.run.workers)"
                )
        if not any(a.op is Op.OFFLOAD for a in self.row):
            return None
        store = host_store(self.device)
        weakref.finalize(self, store.close)  # its files go with the executor
        return store

    def offload(self, a: Action) -> None:
        assert self.store is not None
        packed = stash_away(self.workers[a.stage], a.microbatch)
        self.store.put(a[::2], packed.buffer)
        packed.buffer = None
        self._away[a[::2]] = packed

    def reload(self, a: Action) -> None:
        assert self.store is not None
        stash_back(self.workers[a.stage], a.microbatch, self._away.pop(a[::2]), self.store.take(a[::2]))

    def evict(self, a: Action) -> None:
        """BPipe: the partner keeps the first ``share`` of the microbatch's packed bytes, this rank the rest."""
        assert self.partner is not None
        worker = self.workers[a.stage]
        packed = stash_away(worker, a.microbatch)
        cut = int(round(self.partner.share * packed.buffer.numel()))
        self.partner.lend(a[::2], packed.buffer[:cut])
        packed.buffer = packed.buffer[cut:].clone()
        self._kept[a[::2]] = worker._hold(packed.buffer)
        self._away[a[::2]] = packed

    def load(self, a: Action) -> None:
        assert self.partner is not None
        worker, packed = self.workers[a.stage], self._away.pop(a[::2])
        worker._release([self._kept.pop(a[::2])])
        stash_back(worker, a.microbatch, packed, torch.cat([self.partner.take_back(a[::2]), packed.buffer]))

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
            for stage, worker in self.workers.items():
                if self.placement.stage_part[stage] not in self.replicas.per_action:  # ZeRO-2 keeps none whole
                    worker.prepare_gradients()


def chain(steps: Sequence[Combine]) -> Combine | None:
    """One ``combine`` running ``steps`` in order (None: no step)."""
    if len(steps) <= 1:
        return steps[0] if steps else None

    def combine(worker: StageWorker) -> None:
        for step in steps:
            step(worker)

    return combine


def _replica_groups(placement: Any, context: RankContext) -> dict[int, Any]:
    """The run's replica groups (``context.mesh``), present wherever a part's replicas span ranks."""
    if not replica_rank_sets(placement):
        return {}
    if context.mesh is None:
        raise RuntimeError(
            "replicas on several ranks sum their gradients over the run's mesh: build it first "
            "and give it in the executor's context (transport.mesh.build_mesh, RankContext.with_mesh)"
        )
    return context.mesh.replica_groups
