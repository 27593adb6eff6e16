"""Tied weights in an asynchronous stream: each end applies the summed update once it has both halves.

The literature has no rule for a tie in a pipeline without flushes; this is
pipeweave's. The two ends of a tie split between a pipeline's first and last
stage (the token embedding and the head: ``runtime.stage.tied``) finish an
update's backwards at different times: the last stage's half of update k's
tied gradient (its gradients of the microbatches ``U_k`` applies) is
complete first (the first stage's backward of a microbatch follows it), so
the sum of both halves exists at the first stage first.

- Both copies receive exactly the same sequence of updates: the k-th is
  ``first_k + last_k``, the two ends' halves of the same microbatches,
  summed in that order on both ends, at the same learning rate; so the
  copies never diverge as values, only in when they take a step.
- Each end applies an update at its first ``U`` whose partner's half has
  already been sent, so that neither waits on work still to come. The
  first stage at its ``U_k``: the last stage sent ``last_k`` at its own
  ``U_k``. The last stage at its ``U_(k+d)``, d = ``sim.versions.tied_lag``
  (the fewest updates such that the first stage's ``U_k`` comes before the
  last stage's ``U_(k+d)`` in the order the schedule's dependencies impose):
  PipeDream-2BW with T >= D: 1; with T = D - 1: 2; PipeDream and AMPNet
  (an update per microbatch): D. The last stage's first d updates leave the
  tied members alone (no gradient: the optimizer skips them), and at the
  stream's end (its drain) it applies the d sums it owes, in order, each in
  a step of the tied members alone.
- Staleness: the last stage's tied members lag its other weights by d
  updates, so at the last stage, counted in its own updates, the tied
  gradient it applies is d updates staler than its other weights'. Counted
  in the tied members' own updates it is the worse of the first stage's
  staleness and the last stage's + d (``sim.versions.staleness(...,
  tied=True)``; 2BW with T >= D: 1, as untied). At every drain (evaluation,
  checkpoint, the run's end) the copies are equal, so a checkpoint holds one
  value and a resumed run starts a new stream with nothing owed.

Messages: at each of its ``U`` an end sends its half, one flat tensor keyed
``(stage, TIED, k)``, point to point on the run's transport in the per-pair
order (``transport.order``); in one process it waits in a mailbox. The
first stage's ``U_k`` waits on the last stage's ``U_k``; ``tied_lag``
refuses an order in which that would close a cycle. The last stage's
``U_(k+d)`` needs a message sent before it could be reached: it waits no
longer than a message takes.

Admitted (``ScheduleInfo.ties``, listed by ``schedule.registry.tied_streams``): ``pipedream-2bw`` (the
asynchronous schedule people use), ``pipedream`` (with or without vertical
sync) and ``ampnet``, at a constant learning rate (the last stage applies
sum k at its own update k + d: a scheduled rate would differ between the
copies). PipeMare (per-stage rescheduled rates), SpecTrain and XPipe
(predictions), AvgPipe (replicas averaged) and WPipe refuse a tie.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from pipeweave.errors import UserError
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.stage.tied import (
    flatten,
    hook,
    partial_sums,
    split_groups,
    summed,
    tie_peer,
    tied_groups,
    tied_names,
    unflatten,
    write_sums,
)
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Schedule
from pipeweave.schedule.registry import tied_streams
from pipeweave.sim.versions import tied_lag


def check_stream_ties(spec: ModelSpec, schedule: str, lr_scheduled: bool) -> None:
    """One line for a tie on a stream the rule does not cover: another schedule, a scheduled learning rate."""
    if not tied_groups(spec):
        return
    if schedule not in tied_streams():
        raise UserError(
            f"tied parameters (tied embeddings) train on the asynchronous {', '.join(tied_streams())} "
            f"only, not {schedule}; choose one of them or a synchronous schedule, or untie them "
            "(drop --tie-embeddings, tie_word_embeddings=false)"
        )
    if lr_scheduled:
        raise UserError(
            f"tied parameters on {schedule} take a constant learning rate (the last stage applies each "
            "tied update some updates later); drop --lr-schedule and --lr-warmup, or untie them"
        )


class StreamTies:
    """The rule above for one process's stage workers, through ``p2p`` to stages on other ranks.

    Args:
        schedule: the stream.
        workers: the stage workers of this process, by stage.
        p2p: this rank's ``transport.p2p.P2P`` (None: every stage is in this process).

    Raises:
        ScheduleError: a stream whose order would make the tie wait in a cycle (``sim.versions.tied_lag``).

    Example:
        ties = StreamTies(schedule, workers, p2p)   # ties.hooks: what the tied stages' U run
        ...run the stream...; ties.drain()
    """

    def __init__(self, schedule: Schedule, workers: dict[int, StageWorker], p2p: Any = None) -> None:
        self.placement, self.workers, self.p2p = schedule.placement, workers, p2p
        self.lag = tied_lag(schedule) if any(tied_groups(w.spec) for w in workers.values()) else ()
        self.peer: dict[int, int] = {}
        self.updates: dict[int, int] = {}  # tied stage -> its U done in this stream
        self.kept: dict[int, deque[torch.Tensor]] = {}  # last end -> its halves not yet summed, oldest first
        self.mailbox: dict[tuple[int, int], torch.Tensor] = {}  # (sender stage, k) -> its half, in this process
        self.hooks: dict[int, Callable[[StageWorker], None]] = {}
        """Per tied stage of this process, what its ``U`` runs (``StageWorker.update(combine=...)``)."""
        for stage, worker in workers.items():
            peer = tie_peer(self.placement, stage, worker)
            if peer is not None:
                self.peer[stage], self.updates[stage] = peer, 0
                self.hooks[stage] = hook(self._combine, stage)

    def message(self) -> tuple[torch.dtype, int] | None:
        """Dtype and length of the halves sent to another rank (for ``P2P.tied_message``); None: none is."""
        for stage, peer in self.peer.items():
            if peer not in self.workers:
                worker = self.workers[stage]
                params = dict(worker.module.named_parameters(remove_duplicate=False))
                names = tied_names(worker)
                first = [params[names[g][0]] for g in split_groups(worker)]
                return first[0].dtype, sum(p.numel() for p in first)
        return None

    def ready(self, stage: int) -> bool:
        """Whether ``stage``'s next ``U`` has its partner's half (in-process walks wait on it)."""
        peer = self.peer.get(stage)
        if peer is None or peer == stage:
            return True
        need = self.updates[stage] - (0 if self._is_first(stage) else self.lag[stage])
        return need < 0 or (peer, need) in self.mailbox

    def drain(self) -> None:
        """At the stream's end: every last end applies the sums it still owes, in order, each a step of its tied
        members alone."""
        for stage, kept in self.kept.items():
            worker, owed = self.workers[stage], self.updates[stage] - len(kept)
            while kept:
                mine = partial_sums(worker)  # zeros of the members' shapes: no backward since the last U
                theirs = unflatten(self._receive(self.peer[stage], owed), mine)
                write_sums(worker, summed(theirs, unflatten(kept.popleft(), mine)))
                worker.optimizer.step()  # every other parameter has no gradient: the optimizer skips it
                worker.optimizer.zero_grad(set_to_none=True)
                owed += 1

    def _is_first(self, stage: int) -> bool:
        return stage == self.placement.pipelines[self.placement.pipeline_of(stage)][0]

    def _combine(self, stage: int) -> None:
        """At ``U_k`` of a tied stage: send its half, then set its members' gradients by the rule."""
        worker, peer = self.workers[stage], self.peer[stage]
        if peer == stage:  # every group it holds is whole here
            write_sums(worker, partial_sums(worker, whole=True))
            return
        k = self.updates[stage]
        self.updates[stage] = k + 1
        mine = partial_sums(worker)
        flat = flatten(mine)
        self._send(stage, k, flat)
        if self._is_first(stage):
            write_sums(worker, summed(mine, unflatten(self._receive(peer, k), mine)))
            return
        kept = self.kept.setdefault(stage, deque())
        if k < self.lag[stage]:
            _drop(worker)
        else:
            write_sums(
                worker,
                summed(unflatten(self._receive(peer, k - self.lag[stage]), mine), unflatten(kept.popleft(), mine)),
            )
        kept.append(flat)

    def _send(self, stage: int, k: int, flat: torch.Tensor) -> None:
        peer = self.peer[stage]
        if peer in self.workers:
            self.mailbox[(stage, k)] = flat
        else:
            self.p2p.send_tied(stage, k, self.placement.stage_rank[peer], flat)

    def _receive(self, sender: int, k: int) -> torch.Tensor:
        if sender in self.workers:
            return self.mailbox.pop((sender, k))
        return self.p2p.recv_tied(sender, k, self.placement.stage_rank[sender])  # type: ignore[no-any-return]


def _drop(worker: StageWorker) -> None:
    """No gradient on the worker's split tied members: this update leaves them as they are."""
    params = dict(worker.module.named_parameters(remove_duplicate=False))
    names = tied_names(worker)
    for g in split_groups(worker):
        for name in names[g]:
            params[name].grad = None
