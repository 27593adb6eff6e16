"""Tensor parallelism: a layer's linear submodules split over a ``tp`` process group, Megatron-LM's way.

Shoeybi et al. (Megatron-LM, 2019) split a transformer's matmuls over N
ranks so that a block costs two all-reduces in its forward and two in its
backward: a **column-parallel** linear keeps a slice of the output features
(rows of the weight) and needs its input whole; a **row-parallel** linear
keeps a slice of the input features (columns of the weight), takes its input
already split, and sums the partial outputs with an all-reduce. Attention
splits by heads (each rank's rows of Q, K and V are whole heads), the MLP's
up projection goes column-wise and its down projection row-wise, so the
activation between the two of a pair never leaves its rank. A model names
what to split in a plan (``models.tensor_parallel``); ``split`` applies it to
a layer built whole.

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

Every rank's shards are exactly plain training's weights, cut: a built-in
layer is built whole from the layer's seed and its slice kept; a layer built
on the meta device (``hf:``, ``pipeweave.pipeline()``) is split there and
reads only its slices (``cut_over``, ``models.materialise``). Each shard carries
its ``Split`` (``gather`` puts the whole back, ``shard`` cuts a whole one).
Parameters outside the split layers (norms, embeddings, biases of
row-parallel layers) are replicated: their inputs and gradients are the same
on every rank of the group (what a ``g`` all-reduce gives every rank is
bitwise one value), so their gradients agree without communication -- except
under sequence parallelism, where each rank sees its shard of the sequence
and their gradients are summed over the group (``stage.sequence_parallel``).

Example (on each rank of a group of 2)::

    tp = TensorParallel(group, rank=dist.get_rank(group), size=2)
    (block,) = build_layers(spec, [1])
    block = split(block, tensor_parallel_plan(spec, 1, block), tp, "layer 1")
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from pipeweave.errors import UserError
from pipeweave.models.build import build_layers, tensor_parallel_plan
from pipeweave.models.graph_shard import local_sizes, whole_shapes
from pipeweave.models.layers import Deferrable, FusedLinear, Linear, _accumulate, _deferring, _LinearFn
from pipeweave.models.materialise import Cut, Slice
from pipeweave.models.spec import ModelSpec
from pipeweave.models.tensor_parallel import STYLES
from pipeweave.runtime.stage.sequence_parallel import gathered_linear, reduce_scatter_to_sequence, shard_sequence
from pipeweave.runtime.transport.mesh import MEASURING, TensorParallel


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    t = t.contiguous()
    if group is not MEASURING:
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
        if tp.group is not MEASURING:
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


@dataclass(frozen=True)
class Split:
    """How a parameter is cut over the group: along ``dim``, rank r holding the indices ``owned[r]`` of the whole.

    Kept on the shard as ``param.tensor_parallel_split``: what gathers the whole parameter back (``gather``)
    and cuts a whole one (a checkpoint's) into this rank's shard (``shard``).
    """

    dim: int
    owned: tuple[torch.Tensor, ...]
    """Per rank of the group, the indices along ``dim`` of the whole parameter it holds (int64)."""


def _indices(length: int, size: int) -> tuple[torch.Tensor, ...]:
    return torch.arange(length).chunk(size)


def _shard(param: nn.Parameter | None, tp: TensorParallel, how: Split) -> nn.Parameter | None:
    if param is None:
        return None
    dim = how.dim if param.dim() > 1 else 0  # a bias follows its weight's rows
    piece = nn.Parameter(param.detach().index_select(dim, how.owned[tp.rank]).clone())
    piece.tensor_parallel_split = Split(dim, how.owned)  # type: ignore[attr-defined]
    return piece


def split_of(param: torch.Tensor) -> Split | None:
    """The ``Split`` of a tensor-parallel shard, None for a whole (replicated) parameter."""
    return getattr(param, "tensor_parallel_split", None)


def gather(param: torch.Tensor, tp: TensorParallel, like: torch.Tensor | None = None) -> torch.Tensor:
    """The whole parameter of ``param``'s shards (every rank of the group calls it); ``param`` itself if whole.

    ``like``: the shard ``param`` is cut as, where ``param`` is a tensor of that shard's shape but not the
    shard itself (its optimizer state).
    """
    split = split_of(param if like is None else like)
    if split is None or param.shape != (param if like is None else like).shape:
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(tp.size)]
    dist.all_gather(shards, param.detach().contiguous(), group=tp.group)
    shape = list(param.shape)
    shape[split.dim] = sum(len(i) for i in split.owned)
    whole = param.new_empty(shape)
    for owned, shard in zip(split.owned, shards):
        whole.index_copy_(split.dim, owned.to(param.device), shard)
    return whole


def shard(whole: torch.Tensor, like: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's shard of ``whole``, cut as the shard ``like`` is (``whole`` itself for a whole parameter, or
    where ``whole`` is not of the whole's shape: AdamW's 0-d step)."""
    split = split_of(like)
    if split is None or whole.dim() != like.dim() or whole.shape[split.dim] != sum(len(i) for i in split.owned):
        return whole
    return whole.index_select(split.dim, split.owned[rank].to(whole.device))


class ColumnParallelLinear(Deferrable):
    """A ``Linear`` keeping the output features ``rows[tp.rank]`` of the full layer; the input comes whole.

    ``gather_output``: concatenate every rank's outputs (a vocabulary head before its loss);
    otherwise the output stays split, for a row-parallel layer or a per-head computation next.
    A ``TransposedLinear`` (transformers' ``Conv1D``, weight (in, out)) keeps its weight's columns.
    """

    def __init__(
        self, full: Linear, tp: TensorParallel, rows: tuple[torch.Tensor, ...], *, gather_output: bool = False
    ) -> None:
        super().__init__()
        self.tp, self.gather_output, self.transposed = tp, gather_output, full.transposed
        split = Split(1 if full.transposed else 0, rows)
        self.weight = _shard(full.weight, tp, split)
        self.bias = _shard(full.bias, tp, split)
        self.output_width = sum(len(r) for r in rows) if gather_output else len(rows[tp.rank])
        """The width of this rank's output (``models.graph_shard`` reads it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:  # x: this rank's sequence shard (``stage.sequence_parallel``)
            y = gathered_linear(x, self.weight, self.bias, self.grad_store, self.tp)
        else:
            x = _CopyToTensorParallel.apply(x, self.tp.group)
            y = _LinearFn.apply(x, self.weight, self.bias, self.grad_store, self.transposed)
        return _GatherFromTensorParallel.apply(y, self.tp) if self.gather_output else y  # type: ignore[no-any-return]


class RowParallelLinear(Deferrable):
    """A ``Linear`` keeping the input features ``cols[tp.rank]`` of the full layer; partial outputs summed, then
    the bias (whole on every rank)."""

    def __init__(self, full: Linear, tp: TensorParallel, cols: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.tp, self.transposed = tp, full.transposed
        self.weight = _shard(full.weight, tp, Split(0 if full.transposed else 1, cols))
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        self.output_width = _width(full, out=True)
        """The width of the output, whole (``models.graph_shard`` reads it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _LinearFn.apply(x, self.weight, None, self.grad_store, self.transposed)
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.tp)
        else:
            y = _ReduceFromTensorParallel.apply(y, self.tp.group)
        # Under sequence parallelism the bias gradient is the sum of the gradient's shard, which W would hold
        # beside the gathered whole the weight needs: summed at once instead (b s h / N additions).
        store = None if self.tp.sequence_parallel else self.grad_store
        return y if self.bias is None else _AddBiasFn.apply(y, self.bias, store)  # type: ignore[no-any-return]


def _width(full: Linear, *, out: bool) -> int:
    """The output (``out``) or input features of ``full``, whichever way its weight lies."""
    return int(full.weight.shape[0 if out != full.transposed else 1])


def _colwise(full: Linear, tp: TensorParallel, *, gather_output: bool = False) -> ColumnParallelLinear:
    return ColumnParallelLinear(full, tp, _indices(_width(full, out=True), tp.size), gather_output=gather_output)


def _colwise_parts(full: Linear, tp: TensorParallel, parts: Sequence[int]) -> ColumnParallelLinear:
    """A fused projection (rows: ``parts`` side by side) split part by part: this rank's share of each, in
    order (each part divides by the group's size: ``models.tensor_parallel.check_divisible``)."""
    starts = [sum(parts[:k]) for k in range(len(parts))]
    rows = tuple(
        torch.cat(
            [
                start + torch.arange(r * width // tp.size, (r + 1) * width // tp.size)
                for start, width in zip(starts, parts)
            ]
        )
        for r in range(tp.size)
    )
    return ColumnParallelLinear(full, tp, rows)


def _colwise_qkv(full: Linear, tp: TensorParallel) -> ColumnParallelLinear:
    """A fused QKV projection (rows: Q, K, V of one width) split by heads: this rank's heads of each."""
    return _colwise_parts(full, tp, [_width(full, out=True) // 3] * 3)


def _colwise_fused(full: Linear, tp: TensorParallel) -> ColumnParallelLinear:
    """A ``FusedLinear`` split part by part (grouped-query attention's Q, K, V; SwiGLU's gate and up)."""
    return _colwise_parts(full, tp, full.parts)  # type: ignore[attr-defined]


_STYLE = {
    "colwise": _colwise,
    "colwise_qkv": _colwise_qkv,
    "colwise_fused": _colwise_fused,
    "colwise_gather": lambda full, tp: _colwise(full, tp, gather_output=True),
    "rowwise": lambda full, tp: RowParallelLinear(full, tp, _indices(_width(full, out=False), tp.size)),
}


def split(layer: nn.Module, plan: Mapping[str, str], tp: TensorParallel, where: str) -> nn.Module:
    """``layer`` with the linear submodules ``plan`` names (``{"attn.proj": "rowwise"}``) split over ``tp``.

    A traced part (``pipeweave.pipeline``'s ``fx.GraphModule``) keeps its parameters' own names (bound to the
    shards), and the sizes its graph computes with are made its shard's (``models.graph_shard``).

    Raises:
        UserError: an unknown style, or a name that is not one of the layer's linear layers (``where`` says
            which layer, in the message); a traced part whose code cannot run on its shard.
    """
    whole = whole_shapes(layer) if plan and isinstance(layer, fx.GraphModule) else None
    for name, style in plan.items():
        module = check_entry(layer, name, style, where, tp.size)
        parallel = _STYLE[style](module, tp)
        _rebind(layer, module, parallel)
        if name:
            layer.set_submodule(name, parallel)
        else:
            layer = parallel
    if whole is not None:
        local_sizes(layer, whole, where)  # type: ignore[arg-type]
    return layer


def _rebind(layer: nn.Module, full: nn.Module, parallel: nn.Module) -> None:
    """Every other name in ``layer`` of ``full``'s weight and bias (a traced part's ``model.layers.0.mlp.up_proj
    .weight``) now names ``parallel``'s."""
    for old, new in ((full.weight, parallel.weight), (full.bias, parallel.bias)):
        if old is None:
            continue
        for module in layer.modules():
            for key, param in module._parameters.items():
                if param is old:
                    module._parameters[key] = new


def split_layers(
    spec: ModelSpec, indices: Sequence[int], layers: Sequence[nn.Module], tp: TensorParallel
) -> list[nn.Module]:
    """A stage's layers (``indices`` of ``spec``) split over ``tp`` by the model's plan; sequence-parallel too
    where ``tp`` says so (``stage.sequence_parallel``)."""
    cut = [split(layer, tensor_parallel_plan(spec, i, layer), tp, f"layer {i}") for i, layer in zip(indices, layers)]
    if tp.sequence_parallel:
        shard_sequence(indices, cut, tp)
    return cut


def cut_over(spec: ModelSpec, tp: TensorParallel) -> Callable[[int], Cut]:
    """Per layer index, how this rank of ``tp`` cuts that layer of ``spec`` by the model's plan (``build_layers``
    splits it as it builds it; a layer built on the meta device reads only this rank's slice of each split
    tensor: ``models.materialise``)."""

    def cut(index: int) -> Cut:
        def split_layer(layer: nn.Module) -> nn.Module:
            return split(layer, tensor_parallel_plan(spec, index, layer), tp, f"layer {index}")

        return Cut(split_layer, functools.partial(slice_of, rank=tp.rank))

    return cut


def slice_of(param: torch.Tensor, rank: int) -> Slice | None:
    """The slice of the whole parameter that ``rank``'s shard ``param`` holds (None: ``param`` is whole)."""
    how = split_of(param)
    return None if how is None else (how.dim, how.owned[rank])


def check_plans(spec: ModelSpec, size: int) -> None:
    """Every entry of a custom model's ``tp_plan`` names one of its layer's linear layers and a known style, and
    each planned layer splits over ``size`` ranks (its widths divide; a traced part's code runs on its shard).

    Each planned layer is built on the meta device (no memory; on the CPU if it cannot be built there); of
    layers with one plan (a transformer's blocks), the first.
    """
    plans = spec.custom.tp_plan if spec.kind == "custom" else None
    seen: set[tuple[tuple[str, str], ...]] = set()
    for index, plan in enumerate(plans or []):
        if not plan or tuple(plan.items()) in seen:
            continue
        seen.add(tuple(plan.items()))
        try:
            with torch.device("meta"):
                (layer,) = build_layers(spec, [index])
        except UserError:
            raise
        except Exception:  # a layer built from data
            (layer,) = build_layers(spec, [index])
        split(layer, plan, TensorParallel(MEASURING, 0, size), f"tp_plan[{index}]")


def check_entry(layer: nn.Module, name: str, style: str, where: str, size: int = 1) -> Linear:
    """The linear submodule ``name`` of ``layer`` a plan may split with ``style`` (one line if it may not)."""
    if style not in STYLES:
        raise UserError(f"{where}: style {style!r} for {name!r} is unknown; choose one of: {', '.join(STYLES)}")
    linears = [n for n, m in layer.named_modules() if isinstance(m, Linear)]
    if name not in linears:
        raise UserError(
            f"{where}: the TP plan names {name!r}, which is not a linear layer of it; give one of "
            f"{', '.join(linears) or 'none (it has no linear layer)'}"
        )
    module = layer.get_submodule(name)
    width = _width(module, out=style != "rowwise")  # type: ignore[arg-type]
    parts = 3 if style == "colwise_qkv" else 1
    if width % parts or width // parts % size:
        raise UserError(
            f"{where}: {name}'s {width} {'input' if style == 'rowwise' else 'output'} features are not divisible "
            f"{'in 3 ' if parts == 3 else ''}by --tensor-parallel {size}; give a tensor-parallel degree that divides them"
        )
    if style == "colwise_fused" and not isinstance(module, FusedLinear):
        raise UserError(
            f"{where}: style colwise_fused for {name!r} needs a FusedLinear (its parts' widths); build it as "
            "pipeweave.models.layers.FusedLinear, or give colwise or colwise_qkv"
        )
    return module  # type: ignore[return-value]
