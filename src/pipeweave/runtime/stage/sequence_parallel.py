"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4.2.2): between a block's tensor-parallel regions, activations sharded along the sequence over ``tp``.

Under tensor parallelism alone every rank of the group holds the whole
``(batch, seq, hidden)`` activation of the layer norms and residual adds,
the same on each. Korthikanti et al. shard those along the sequence instead:
entering a column-parallel region the shards are all-gathered along the
sequence (the paper's ``g``; its backward a reduce-scatter of the partial
input gradients), leaving a row-parallel region the partial outputs are
reduce-scattered along the sequence (``g-bar``; its backward an all-gather).
Each pair replaces one all-reduce, bytes for bytes, and the activations
between, and the messages between pipeline stages, shrink N-fold.

Here the sequence is dimension 1 (the gpt's ``(batch, seq, hidden)``). The
embedding (every rank holds it whole) computes the whole sequence and keeps
its shard (``scatter_output``: backward, the shards' gradients all-gathered,
so its own gradients are whole on every rank as under TP alone). A parameter
held whole by every rank that sees only its shard of the sequence -- the
layer norms, a row-parallel layer's bias -- gets a partial gradient: they are
marked (``mark_partial``) and summed over ``tp`` at ``U`` (``PartialGradients``),
after the replicas' reduction and before clipping, as Megatron-LM all-reduces
its layer norms' gradients. A column-parallel layer keeps only its input's
shard from F to its backward and all-gathers it again there, as Megatron-LM
does (``gathered_linear``). Every collective is on the input gradient's path
(``I``, or ``B``): ``W`` takes the input gathered in ``I`` and stays local
work on the shard. The gpt has no dropout, so no random mask is split (other
models are refused: ``runtime.run.prepare``).

Example (on each rank of a group of 2, ``x`` of shape ``(batch, seq, hidden)``)::

    tp = TensorParallel(group, rank, 2, sequence_parallel=True)
    shard = scatter_to_sequence(x, tp)                        # (batch, seq / 2, hidden)
    y = gathered_linear(shard, weight, None, store, tp)       # (batch, seq, out): g, then the product
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeweave.models.layers import linear_backward, linear_forward
from pipeweave.runtime.transport.mesh import MEASURING, TensorParallel

SEQUENCE = 1
"""The sequence dimension of the activations sharded (``(batch, seq, hidden)``)."""


def _gather(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The shards of every rank, concatenated along the sequence (in rank order)."""
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    if tp.group is MEASURING:
        parts[tp.rank] = x
    else:
        dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=SEQUENCE)


def _reduce_scatter(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's sequence shard of the sum over the group of ``x``."""
    parts = [p.contiguous() for p in x.chunk(tp.size, dim=SEQUENCE)]
    out = torch.empty_like(parts[tp.rank])
    if tp.group is MEASURING:
        return out.copy_(parts[tp.rank])
    dist.reduce_scatter(out, parts, group=tp.group)
    return out


def _own(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x.chunk(tp.size, dim=SEQUENCE)[tp.rank].contiguous()


class _SequenceCollective(torch.autograd.Function):
    """``forward(x)`` forward, ``backward(grad)`` backward: one of the conjugate pairs below (the paper's ``g``,
    all-gather forward and reduce-scatter backward, is inside ``gathered_linear``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, forward: Any, backward: Any) -> torch.Tensor:
        ctx.tp, ctx.backward_fn = tp, backward
        return forward(x, tp)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.backward_fn(grad, ctx.tp), None, None, None


def reduce_scatter_to_sequence(y: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The paper's ``g-bar`` behind a row-parallel layer: partial outputs reduce-scattered along the sequence
    forward; the gradient's shards all-gathered backward."""
    return _SequenceCollective.apply(y, tp, _reduce_scatter, _gather)  # type: ignore[no-any-return]


def scatter_to_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A whole activation (the same on every rank) cut to this rank's sequence shard; backward, the shards'
    gradients all-gathered (whole on every rank again)."""
    return _SequenceCollective.apply(x, tp, _own, _gather)  # type: ignore[no-any-return]


class _GatheredLinearFn(torch.autograd.Function):
    """A column-parallel linear on a sequence shard: the shard all-gathered, the product on the whole sequence,
    only the shard kept. Its backward (``I``, or ``B``) all-gathers the shard again for the weight gradient
    (deferred to ``W`` with the gathered input: ``W`` stays local) and reduce-scatters the input gradient."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: Any, tp: TensorParallel
    ) -> torch.Tensor:
        ctx.tp = tp
        whole, y = linear_forward(ctx, _gather(x, tp), weight, bias, store)
        ctx.save_for_backward(_own(whole, tp))  # (as the product read it: cast under autocast)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        (shard,) = ctx.saved_tensors
        gx = linear_backward(ctx, _gather(shard, ctx.tp), gy)
        return None if gx is None else _reduce_scatter(gx, ctx.tp), None, None, None, None


def gathered_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: Any, tp: TensorParallel
) -> torch.Tensor:
    """``linear(gather_from_sequence(x))`` holding ``x``'s shard, not the gathered whole, from F to the backward
    (as Megatron-LM's sequence-parallel linear does): the paper's ``34 s b h / N`` per block."""
    return _GatheredLinearFn.apply(x, weight, bias, store, tp)  # type: ignore[no-any-return]


def scatter_output(layer: nn.Module, tp: TensorParallel) -> None:
    """``layer``'s output (whole on every rank: the embedding's) cut to this rank's sequence shard."""
    layer.register_forward_hook(lambda module, args, out: scatter_to_sequence(out, tp))


def shard_sequence(indices: Iterable[int], layers: Iterable[nn.Module], tp: TensorParallel) -> None:
    """A gpt's layers, split over ``tp``, made sequence-parallel: the embedding (layer 0) keeps its shard of the
    sequence; the blocks' and the head's whole parameters are marked partial."""
    for index, layer in zip(indices, layers):
        if index == 0:
            scatter_output(layer, tp)
        else:
            mark_partial(layer)


def mark_partial(layer: nn.Module) -> None:
    """Mark the parameters of ``layer`` held whole on every rank (no tensor-parallel ``Split``) whose gradient,
    computed from a sequence shard, is partial: summed over ``tp`` at ``U``."""
    for param in layer.parameters():
        if getattr(param, "tensor_parallel_split", None) is None:
            param.sequence_parallel = True  # type: ignore[attr-defined]


def is_partial(param: torch.Tensor) -> bool:
    """True for a parameter ``mark_partial`` marked."""
    return getattr(param, "sequence_parallel", False)


def sum_partial(params: list[nn.Parameter], tp: TensorParallel) -> None:
    """Sum the marked parameters' gradients over ``tp`` in place: one all-reduce of them flattened."""
    marked = [p for p in params if is_partial(p)]
    for p in marked:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not marked:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in marked])  # type: ignore[union-attr]
    dist.all_reduce(flat, group=tp.group)
    for p, piece in zip(marked, flat.split([p.numel() for p in marked])):
        p.grad.copy_(piece.view_as(p))  # type: ignore[union-attr]


class PartialGradients:
    """Sums the partial gradients of sequence-parallel stages over ``tp`` at their ``U``.

    The executor runs ``hooks`` after the replicas' reduction (sums over ``dp`` and ``tp`` commute), before
    the ties' and the clipping's.

    Attributes:
        hooks: per sequence-parallel stage, what its ``U`` runs (``StageWorker.update(combine=...)``).
    """

    def __init__(self, workers: dict[int, Any]) -> None:
        self.hooks: dict[int, Callable[[Any], None]] = {}
        for stage, worker in workers.items():
            tp = worker.tensor_parallel
            if tp is not None and tp.sequence_parallel:
                self.hooks[stage] = self._sum(tp)

    @staticmethod
    def _sum(tp: TensorParallel) -> Callable[[Any], None]:
        def combine(worker: Any) -> None:
            sum_partial(list(worker.module.parameters()), tp)

        return combine
