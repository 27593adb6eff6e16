"""Linear and Embedding whose weight gradients can be deferred (zero bubble's W), and LayerNorm.

Zero-bubble pipelining (Qi et al., ICLR 2024) splits a backward into ``I``
(input gradients, on the critical path) and ``W`` (weight gradients, deferred).
Running autograd twice, or keeping the graph alive until ``W``, would pay the
backward twice. Instead every layer with parameters here is a custom autograd
function: during ``I`` its backward returns only the input gradient and hands
a small closure -- holding exactly what its weight gradient needs (the layer
input and the output gradient, M_W of the paper) -- to a ``WeightGradStore``;
the autograd graph itself is freed as usual. ``W`` runs the closures.
LayerNorm computes its (elementwise, cheap) weight gradient at once even then,
so that ``W`` keeps about what the forward kept, not more. Outside
``I`` (a full backward ``B``, or plain training) the same backward computes the
weight gradients at once by the same code, so ``I`` + ``W`` equals ``B``. Either
way they are accumulated straight into ``param.grad`` (``addmm_`` with beta 1,
``index_add_``), never returned to autograd: that saves a weight-sized
temporary and a separate accumulation pass per layer and microbatch.

Under ``torch.autocast`` (``--precision bf16``) the linear layer computes as
``nn.Linear`` does there: input, weight and bias cast to the autocast dtype,
the output in that dtype, the cast input kept for the weight gradient (half
the bytes), the weight cast again at the backward; its weight gradient is
computed in that dtype and accumulated into the float32 ``param.grad``, as
autograd accumulates an autocast ``nn.Linear``'s. LayerNorm and Embedding
compute in their input's dtype, as the built-in ones do on the CPU.

Parameter initialisation takes an explicit ``torch.Generator`` so that a layer
is identical whatever rank builds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pipeweave.models.context_parallel import SequenceShard
from pipeweave.models.precision import autocast_device_type

WeightGrad = Callable[[], None]
"""A deferred weight-gradient computation; it accumulates into ``param.grad``."""


class WeightGradStore:
    """Collects the weight-gradient closures of one stage while ``deferring`` is set.

    The stage worker sets ``deferring`` around an ``I`` and moves ``pending`` to
    its per-microbatch queue; ``on_stash`` (optional) sees every tensor a
    closure keeps, for activation accounting.
    """

    def __init__(self) -> None:
        self.deferring = False
        self.pending: list[tuple[WeightGrad, tuple[torch.Tensor, ...]]] = []

    def defer(self, fn: WeightGrad, held: tuple[torch.Tensor, ...]) -> None:
        self.pending.append((fn, held))


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    # Same semantics as autograd's AccumulateGrad (first gradient is stored, later ones added).
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _deferring(store: WeightGradStore | None) -> bool:
    return store is not None and store.deferring


def _linear_weight_grads(
    weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, gy: torch.Tensor, transposed: bool = False
) -> None:
    """Accumulate ``gy^T x`` into ``weight.grad`` (``x^T gy`` for a transposed weight, (in, out)), and
    ``sum(gy)`` into ``bias.grad``.

    Straight into ``.grad`` with ``addmm_`` (beta = 1): no temporary weight-sized
    gradient, no separate pass to add it, where autograd's own path pays both.
    B and W both come here, so I + W equals B bitwise for the same microbatch order.
    """
    gy2 = gy.reshape(-1, gy.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    left, right = (x2.t(), gy2) if transposed else (gy2.t(), x2)
    if x2.dtype != weight.dtype:  # autocast: the product in its dtype, accumulated in the parameter's
        _accumulate(weight, left.mm(right).to(weight.dtype))
        if bias is not None:
            _accumulate(bias, gy2.sum(0).to(bias.dtype))
        return
    if weight.grad is None:
        weight.grad = left.mm(right)
    else:
        weight.grad.addmm_(left, right)
    if bias is not None:
        _accumulate(bias, gy2.sum(0))


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` gives a linear layer on ``x``'s device now, or None outside autocast."""
    kind = autocast_device_type(x.device)
    if not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if x.is_floating_point() and x.dtype != torch.float64 else None


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: Any, transposed: bool = False
    ) -> torch.Tensor:
        x, y = linear_forward(ctx, x, weight, bias, store, transposed)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        return linear_backward(ctx, x, gy), None, None, None, None


def linear_forward(
    ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: Any, transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deferrable linear's forward inside an autograd function's ``forward``: ``(x as the product read it, y)``;
    what its backward (``linear_backward``) needs besides ``x`` kept on ``ctx``."""
    # Parameters travel as attributes: a saved tensor unpacks to a different
    # Python object, and .grad must land on the Parameter itself.
    ctx.weight, ctx.bias = weight, bias
    ctx.store, ctx.transposed = store, transposed  # transposed: y = b + x W, W (in, out) (Conv1D's addmm)
    ctx.dtype = dtype = _autocast_dtype(x)
    if dtype is not None:  # as autocast runs nn.Linear: everything cast, the cast input kept
        x = x.to(dtype)
        with torch.autocast(autocast_device_type(x.device), enabled=False):
            return x, _product(x, weight.to(dtype), None if bias is None else bias.to(dtype), transposed)
    return x, _product(x, weight, bias, transposed)


def linear_backward(ctx: Any, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor | None:
    """The input gradient of ``linear_forward``'s product; its weight gradient deferred to ``W`` (or, in ``B``,
    accumulated at once)."""
    weight, bias = ctx.weight, ctx.bias
    if ctx.dtype is not None:
        gy = gy.to(ctx.dtype)
    w = weight if ctx.dtype is None else weight.to(ctx.dtype)
    gx = (gy.mm(w.t()) if ctx.transposed else gy.matmul(w)) if ctx.needs_input_grad[0] else None
    transposed = ctx.transposed
    if _deferring(ctx.store):
        ctx.store.defer(lambda: _linear_weight_grads(weight, bias, x, gy, transposed), (x, gy))
    else:  # B: at once, by the same code as W
        _linear_weight_grads(weight, bias, x, gy, transposed)
    return gx


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:  # a row-parallel shard's bias is added after the sum (``stage.tensor_parallel``)
        return torch.addmm(bias, x, weight) if bias is not None else x.matmul(weight)
    return F.linear(x, weight, bias)


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        y, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd)
        ctx.weight, ctx.bias = weight, bias
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        # Never deferred: its weight gradient is elementwise work, negligible next to
        # the matmuls, while deferring it would keep x and gy (2 x width per sample)
        # alive until W. Zero bubble's own implementation defers its linear layers'.
        x, mean, rstd = ctx.saved_tensors
        mask = [bool(ctx.needs_input_grad[0]), True, True]
        return (
            *torch.ops.aten.native_layer_norm_backward(gy, x, [x.shape[-1]], mean, rstd, ctx.weight, ctx.bias, mask),
            None,
        )


def _embedding_weight_grads(
    idx: torch.Tensor,
    gy: torch.Tensor,
    token: torch.Tensor,
    position: torch.Tensor | None,
    at: torch.Tensor | None = None,
) -> None:
    """Accumulate the token and position gradients into ``.grad`` in place (as the linear layer does); ``at``:
    the global positions of the tokens (context parallelism), None for ``0..seq-1``."""
    width = gy.shape[-1]
    if token.grad is None:
        token.grad = torch.zeros_like(token)
    token.grad.index_add_(0, idx.reshape(-1), gy.reshape(-1, width))
    if position is None:
        return
    if position.grad is None:
        position.grad = torch.zeros_like(position)
    summed = gy.reshape(-1, gy.shape[-2], width).sum(0)
    if at is None:
        position.grad[: gy.shape[-2]] += summed
    else:
        position.grad.index_add_(0, at, summed)


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        idx: torch.Tensor,
        token: torch.Tensor,
        position: torch.Tensor | None,
        store: Any,
        at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.token, ctx.position, ctx.at = token, position, at
        ctx.store = store
        y = F.embedding(idx, token)
        if position is None:
            return y
        return y + (position[: idx.shape[-1]] if at is None else position.index_select(0, at))

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        (idx,) = ctx.saved_tensors
        token, position, at = ctx.token, ctx.position, ctx.at
        if _deferring(ctx.store):
            ctx.store.defer(lambda: _embedding_weight_grads(idx, gy, token, position, at), (idx, gy))
        else:
            _embedding_weight_grads(idx, gy, token, position, at)
        return None, None, None, None, None


class Deferrable(nn.Module):
    """Base of the layers here: ``grad_store`` is set by the stage that owns the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_store: WeightGradStore | None = None


class Linear(Deferrable):
    """``y = x W^T + b``, PyTorch's default uniform(-1/sqrt(in), 1/sqrt(in)) initialisation."""

    transposed = False
    """Whether ``weight`` is (in, out) (``TransposedLinear``) rather than (out, in)."""

    def __init__(self, in_features: int, out_features: int, *, generator: torch.Generator, bias: bool = True) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features).uniform_(-bound, bound, generator=generator))
        self.bias = (
            nn.Parameter(torch.empty(out_features).uniform_(-bound, bound, generator=generator)) if bias else None
        )

    @classmethod
    def wrapping(cls, linear: nn.Linear) -> Linear:
        """A ``Linear`` on the very parameters of ``linear`` (same objects, same values)."""
        return cls.on(cast(nn.Parameter, linear.weight), cast(nn.Parameter | None, linear.bias))

    @classmethod
    def on(cls, weight: nn.Parameter, bias: nn.Parameter | None) -> Linear:
        """A ``Linear`` on these very parameters (``weight`` of shape (out, in))."""
        layer = cls.__new__(cls)
        Deferrable.__init__(layer)
        layer.weight, layer.bias = weight, bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.bias, self.grad_store)  # type: ignore[no-untyped-call,no-any-return]


class TransposedLinear(Linear):
    """``y = b + x W`` with ``W`` of shape (in, out): transformers' ``Conv1D`` (GPT-2), as ``aten.addmm``
    computes it, on the same parameters; its weight gradient ``x^T gy`` is deferred as ``Linear``'s is."""

    transposed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.bias, self.grad_store, True)  # type: ignore[no-untyped-call,no-any-return]


class FusedLinear(Linear):
    """A ``Linear`` whose output features are several projections side by side, ``parts`` wide each (grouped-query
    attention's Q, K and V; SwiGLU's gate and up): one GEMM for all. Tensor parallelism splits each part apart
    (style ``colwise_fused``), so a rank's output holds its share of every part, in the same order."""

    def __init__(self, in_features: int, parts: tuple[int, ...], *, generator: torch.Generator) -> None:
        super().__init__(in_features, sum(parts), generator=generator, bias=False)
        self.parts = parts


class LayerNorm(nn.Module):
    """Layer normalisation over the last dimension with an affine weight and bias."""

    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LayerNormFn.apply(x, self.weight, self.bias, self.eps)  # type: ignore[no-untyped-call,no-any-return]


class Embedding(Deferrable):
    """Token plus learned position embedding: ``token[idx] + position[:seq]``; the token alone where
    ``max_len`` is None (positions given by the attention itself: rotary).

    ``sequence``: which part of every sequence ``idx`` holds under context parallelism (``models.context_parallel``:
    its tokens' positions are their global ones); None for whole sequences."""

    sequence: SequenceShard | None = None

    def __init__(self, vocab: int, width: int, max_len: int | None, *, generator: torch.Generator) -> None:
        super().__init__()
        self.token = nn.Parameter(self.initial_token(vocab, width, generator))
        self.position = (
            None
            if max_len is None
            else nn.Parameter(torch.empty(max_len, width).normal_(0.0, 0.02, generator=generator))
        )

    @staticmethod
    def initial_token(vocab: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """The token table's initial values: GPT-2's scale (std 0.02), drawn first from the layer's generator."""
        return torch.empty(vocab, width).normal_(0.0, 0.02, generator=generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        at = None if self.sequence is None else self.sequence.positions(idx.shape[-1], idx.device)
        return _EmbeddingFn.apply(idx, self.token, self.position, self.grad_store, at)  # type: ignore[no-untyped-call,no-any-return]
