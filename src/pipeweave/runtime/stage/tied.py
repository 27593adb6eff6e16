"""Tied weights across stages: the gpt's token embedding and output head, kept identical by summing their gradients.

With ``ModelSpec(tie_embeddings=True)`` the first layer's ``token`` table and
the last layer's ``out.weight`` start equal (``models.gpt``). They live on the
first and the last stage of a pipeline, usually on different ranks. Before
either stage's update (``StageWorker.combine_grads``, after the replicas of a
part are combined) the two stages exchange these gradients and both set theirs
to ``embedding's + head's``, summed in that order on both sides, so the two
copies take bitwise the same step: the gradient a single shared parameter
would get. Between ranks the exchange is a tagged ``isend``/``irecv`` pair at
``U``; in one process (the reference executor, or both ends on one rank) the
first of the two updates sums for both.

Every rank's ``U`` ends its step in synchronous schedules, so the exchange
waits only on gradients that are complete: it cannot deadlock. In one process
the walk must not run a tied stage's ``U`` before its peer's part is done:
``peer_parts`` names the parts to wait for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.transport.mesh import process_of
from pipeweave.schedule.ir import Placement

EMBEDDING, HEAD = "token", "out.weight"


def tied_names(worker: StageWorker) -> dict[str, str]:
    """The tied parameters this worker holds: global name -> ``"embedding"`` or ``"head"``."""
    spec = worker.spec
    if not getattr(spec, "tie_embeddings", False):
        return {}
    ends = {f"0.{EMBEDDING}": "embedding", f"{spec.num_layers - 1}.{HEAD}": "head"}
    return {name: end for name, end in ends.items() if name in worker.named_parameters()}


def tie_peer(placement: Placement, stage: int, worker: StageWorker) -> int | None:
    """The stage holding the other end of ``stage``'s tie (itself if it holds both), or None if untied.

    The embedding is on the first stage of a pipeline and the head on its last.
    """
    if not tied_names(worker):
        return None
    line = placement.pipelines[placement.pipeline_of(stage)]
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
    """

    def __init__(self, placement: Placement, workers: dict[int, StageWorker], rank: int | None = None,
                 tag_base: int = 0) -> None:
        self.placement, self.workers, self.rank, self.tag_base = placement, workers, rank, tag_base
        self._pending: set[tuple[int, int]] = set()  # local pairs summed once, awaiting the second U
        self.peer: dict[int, int] = {}
        for stage, worker in workers.items():
            peer = tie_peer(placement, stage, worker)
            if peer is not None:
                self.peer[stage] = peer
                worker.combine_grads = self._chain(stage, worker.combine_grads)

    def _chain(self, stage: int, before: Callable[[StageWorker], None] | None) -> Callable[[StageWorker], None]:
        def combine(worker: StageWorker) -> None:
            if before is not None:
                before(worker)  # replicas of the part first: every replica then holds the same sum
            self._combine(stage)

        return combine

    def _combine(self, stage: int) -> None:
        peer = self.peer[stage]
        if peer == stage:  # one stage holds both ends
            grads = _grads(self.workers[stage])
            _write(grads, grads["embedding"] + grads["head"])
        elif peer in self.workers:
            self._combine_local(stage, peer)
        else:
            self._combine_remote(stage, peer)

    def _combine_local(self, stage: int, peer: int) -> None:
        pair = (min(stage, peer), max(stage, peer))
        if pair in self._pending:  # the peer's update already summed for both
            self._pending.remove(pair)
            return
        mine, theirs = _grads(self.workers[stage]), _grads(self.workers[peer])
        both = {**mine, **theirs}
        total = both["embedding"] + both["head"]
        _write(mine, total)
        _write(theirs, total)
        self._pending.add(pair)

    def _combine_remote(self, stage: int, peer: int) -> None:
        grads = _grads(self.workers[stage])
        (end, grad), = grads.items()
        other = torch.empty_like(grad)
        peer_rank = process_of(self.placement.stage_rank[peer])  # with this process's tensor-parallel coordinate
        send = dist.isend(grad.contiguous(), dst=peer_rank, tag=self.tag_base + stage)
        recv = dist.irecv(other, src=peer_rank, tag=self.tag_base + peer)
        assert send is not None and recv is not None
        recv.wait()
        send.wait()
        total = grad + other if end == "embedding" else other + grad  # the same order on both ranks
        _write(grads, total)


def _grads(worker: StageWorker) -> dict[str, torch.Tensor]:
    """The gradients of the worker's tied parameters by end, zeros where none was computed."""
    params = worker.named_parameters()
    out = {}
    for name, end in tied_names(worker).items():
        p = params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out[end] = p.grad
    return out


def _write(grads: dict[str, torch.Tensor], total: torch.Tensor) -> None:
    for grad in grads.values():
        grad.copy_(total)
