"""Tensor parallelism: linear layers split over a ``tp`` process group, Megatron-LM's way, W deferrable.

Shoeybi et al. (Megatron-LM, 2019) split a transformer's matmuls over N
ranks so that a block costs two all-reduces in its forward and two in its
backward: a **column-parallel** linear keeps a slice of the output features
(rows of the weight) and needs its input whole; a **row-parallel** linear
keeps a slice of the input features (columns of the weight), takes its input
already split, and sums the partial outputs with an all-reduce. Attention
splits by heads (each rank's rows of Q, K and V are whole heads), the MLP's
up projection goes column-wise and its down projection row-wise, so the
activation between the two of a pair never leaves its rank.

The two collectives are the paper's conjugate operators, written as autograd
functions with explicit ``torch.distributed`` calls: ``f`` (identity forward,
all-reduce of the input gradient backward, in front of a column-parallel
layer) and ``g`` (all-reduce forward, identity backward, behind a
row-parallel one). ``torch.distributed.tensor.parallel``'s
``ColwiseParallel``/``RowwiseParallel`` run the same collectives through
DTensor, but DTensor's linear computes its weight gradient inside the
backward: zero-bubble schedules need it deferred to ``W``. Here the local
matmuls are ``models.layers``'s deferrable ``Linear``, so ``I`` runs the
collectives (they are on the input gradient's path) and ``W`` is local work
on the shard, as the zero-bubble paper runs it inside Megatron's layers.

Every rank builds the full layer from the layer's seed and keeps its slice,
so the shards are exactly plain training's weights, cut. Parameters outside
the split layers (norms, embeddings, biases of row-parallel layers) are
replicated: their inputs and gradients are the same on every rank of the
group (what a ``g`` all-reduce gives every rank is bitwise one value), so
their gradients agree without communication. The vocabulary head may be
column-parallel with its logits gathered (``gather_output``) before the
loss.

Example (on each rank of a tp group ``group`` of size 2)::

    tp = TensorParallel(group, rank=dist.get_rank(group), size=2)
    layers = parallelize(spec, build_layers(spec, range(1, 3)), range(1, 3), tp)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.layers import Deferrable, Linear, _accumulate, _deferring, _LinearFn

STYLES = ("colwise", "rowwise")
"""The split styles a TP plan names: ``colwise`` (output features split), ``rowwise`` (input features)."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group: the group, its rank in it, its size N."""

    group: Any
    """The ``torch.distributed`` process group of the N ranks that split each layer (None: the default group)."""
    rank: int
    size: int

    def slice(self, length: int) -> slice:
        """This rank's contiguous share of ``length`` (a multiple of ``size``)."""
        share = length // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward; the input gradient's partial sums all-reduced backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: partial outputs all-reduced forward; the gradient passes through backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Column shards concatenated along the last dimension forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp, ctx.width = tp, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x.contiguous(), group=tp.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        start = ctx.tp.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


class _AddBiasFn(torch.autograd.Function):
    """``y + bias`` behind a row-parallel layer's reduction; the bias gradient deferred to ``W`` like a weight's."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, bias: torch.Tensor, store: Any) -> torch.Tensor:
        ctx.bias, ctx.store = bias, store
        return y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        bias = ctx.bias

        def bias_grad() -> None:
            _accumulate(bias, gy.reshape(-1, gy.shape[-1]).sum(0).to(bias.dtype))

        if _deferring(ctx.store):
            ctx.store.defer(bias_grad, (gy,))
        else:
            bias_grad()
        return gy, None, None


def _shard(param: nn.Parameter | None, rows: Any = slice(None), cols: Any = slice(None)) -> nn.Parameter | None:
    if param is None:
        return None
    return nn.Parameter(param.detach()[rows][..., cols].clone() if param.dim() > 1 else param.detach()[rows].clone())


class ColumnParallelLinear(Deferrable):
    """A ``Linear`` keeping the output features ``rows`` of the full layer; the input comes whole.

    ``gather_output``: concatenate every rank's outputs (a vocabulary head before its loss);
    otherwise the output stays split, for a row-parallel layer or a per-head computation next.
    """

    def __init__(self, full: Linear, tp: TensorParallel, rows: Any, *, gather_output: bool = False) -> None:
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        self.weight = _shard(full.weight, rows)
        self.bias = _shard(full.bias, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.tp.group)
        y = _LinearFn.apply(x, self.weight, self.bias, self.grad_store)
        return _GatherFromTensorParallel.apply(y, self.tp) if self.gather_output else y  # type: ignore[no-any-return]


class RowParallelLinear(Deferrable):
    """A ``Linear`` keeping the input features ``cols`` of the full layer; partial outputs summed, then the bias."""

    def __init__(self, full: Linear, tp: TensorParallel, cols: Any) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _shard(full.weight, cols=cols)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _LinearFn.apply(x, self.weight, None, self.grad_store)
        y = _ReduceFromTensorParallel.apply(y, self.tp.group)
        return y if self.bias is None else _AddBiasFn.apply(y, self.bias, self.grad_store)  # type: ignore[no-any-return]


def colwise(full: nn.Module, tp: TensorParallel, *, gather_output: bool = False) -> ColumnParallelLinear:
    """``full`` (a pipeweave ``Linear``) split by output features, this rank's contiguous share."""
    return ColumnParallelLinear(_linear(full), tp, tp.slice(_linear(full).weight.shape[0]), gather_output=gather_output)


def rowwise(full: nn.Module, tp: TensorParallel) -> RowParallelLinear:
    """``full`` (a pipeweave ``Linear``) split by input features, this rank's contiguous share."""
    return RowParallelLinear(_linear(full), tp, tp.slice(_linear(full).weight.shape[1]))


def heads_colwise(full: nn.Module, tp: TensorParallel, heads: int) -> ColumnParallelLinear:
    """A fused QKV projection (rows: Q, K, V, each ``heads`` heads) split by heads: this rank's heads of each."""
    linear = _linear(full)
    width = linear.weight.shape[0] // 3
    mine = tp.slice(heads)
    per_head = width // heads
    rows = torch.cat([torch.arange(part * width + mine.start * per_head, part * width + mine.stop * per_head)
                      for part in range(3)])
    return ColumnParallelLinear(linear, tp, rows)


def _linear(module: nn.Module) -> Linear:
    if not isinstance(module, Linear):
        raise UserError(f"a tensor-parallel style applies to a linear layer, not {type(module).__name__}")
    return module


def apply_plan(layer: nn.Module, plan: Mapping[str, str], tp: TensorParallel, where: str) -> nn.Module:
    """Replace the submodules ``plan`` names (``"attn.proj": "rowwise"``) by their tensor-parallel splits."""
    for name, style in plan.items():
        if style not in STYLES:
            raise UserError(f"{where}: style {style!r} for {name!r} is unknown; choose one of: {', '.join(STYLES)}")
        try:
            module = layer.get_submodule(name)
        except AttributeError:
            raise UserError(f"{where}: the TP plan names {name!r}, which the layer does not have; give one of "
                            f"its linear layers ({', '.join(_linear_names(layer)) or 'none'})") from None
        split = colwise(module, tp) if style == "colwise" else rowwise(module, tp)
        if name:
            layer.set_submodule(name, split)
        else:
            layer = split
    return layer


def _linear_names(layer: nn.Module) -> list[str]:
    return [n for n, m in layer.named_modules() if isinstance(m, Linear)]


def check_divisible(what: Sequence[tuple[str, int]], size: int) -> None:
    """One line naming the first dimension that ``size`` ranks cannot split evenly."""
    for name, value in what:
        if value % size:
            raise UserError(f"{name} {value} is not divisible by --tensor-parallel {size}; give a tensor-parallel "
                            f"degree that divides it")
