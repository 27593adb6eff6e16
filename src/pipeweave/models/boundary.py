"""What flows between two layers: one tensor, or a tuple of tensors (e.g. hidden states and a mask).

A layer returning a tuple hands the next layer its elements as arguments
(``layer(*x)``), as ``torch.distributed.pipelining`` stages take several
inputs and DeepSpeed's pipeline layers pass tuples. Every element keeps the
samples in dimension 0, so a batch splits into microbatches element by
element. Backward, the floating-point elements are the differentiable ones:
a stage's input gradient is one tensor for a tensor, and for a tuple the
tuple of its floating-point elements' gradients (zeros where one was not
used), in order. The reference models pass one tensor; this module is what
lets a custom model pass more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Boundary = torch.Tensor | tuple[torch.Tensor, ...]
MAX_TENSORS = 8
"""The most tensors a tuple may hold (its layout travels in a fixed-size metadata message)."""


def call(layer: Callable[..., Any], x: Boundary) -> Any:
    """``layer(x)``, or ``layer(*x)`` for a tuple."""
    return layer(*x) if isinstance(x, tuple) else layer(x)


def tensors(x: Boundary) -> tuple[torch.Tensor, ...]:
    """The tensors of ``x``: itself alone, or the tuple's elements."""
    return x if isinstance(x, tuple) else (x,)


def apply(fn: Callable[[torch.Tensor], torch.Tensor], x: Boundary) -> Boundary:
    """``fn`` on each tensor of ``x``, keeping its structure."""
    return tuple(fn(t) for t in x) if isinstance(x, tuple) else fn(x)


def to(x: Boundary, device: torch.device | str) -> Boundary:
    """``x`` on ``device``, keeping its structure."""
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)


def normalize(x: Any) -> Boundary:
    """A collated batch as a boundary: a list (``default_collate`` of tuples) becomes a tuple."""
    return tuple(x) if isinstance(x, list) else x


def differentiable(x: Boundary) -> list[torch.Tensor]:
    """The floating-point tensors of ``x``, in order: those a gradient flows back to."""
    return [t for t in tensors(x) if t.is_floating_point()]


def input_gradient(x: Boundary) -> Boundary | None:
    """The gradient to send back for a stage input ``x`` after its backward (None: ``x`` needs none).

    A tensor: its ``.grad``. A tuple: its floating-point elements' gradients,
    zeros where the stage did not use one.
    """
    if not isinstance(x, tuple):
        return x.grad if x.requires_grad else None
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in x if t.is_floating_point())


def roots(out: Boundary, grad: Boundary) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs to run a backward from and their gradients: the differentiable ones with a graph.

    Raises:
        RuntimeError: ``grad`` does not have one tensor per floating-point output.
    """
    outputs, grads = differentiable(out), tensors(grad)
    if len(outputs) != len(grads):
        raise RuntimeError(f"{len(grads)} gradients for a stage output with {len(outputs)} floating-point tensors")
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def split(
    batch: Boundary, num_microbatches: int, split_one: Callable[[torch.Tensor, int], Sequence[torch.Tensor]]
) -> list[Boundary]:
    """Microbatches of ``batch``: each tensor split by ``split_one``, tuples zipped back together."""
    if not isinstance(batch, tuple):
        return list(split_one(batch, num_microbatches))
    return [tuple(parts) for parts in zip(*(split_one(t, num_microbatches) for t in batch))]


def num_samples(x: Boundary) -> int:
    """Dimension 0 of the first tensor of ``x``."""
    return len(tensors(x)[0])


def nbytes(x: Boundary) -> int:
    """Bytes of the tensors of ``x``."""
    return sum(t.nbytes for t in tensors(x))
