"""The model configuration, the lazy layer list it describes, and how layers are cut into parts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pipeweave.config.model import KINDS, ModelSpec  # noqa: F401  (re-exported: the model section)
from pipeweave.errors import UserError

LossFn = Callable[[Any, Any], torch.Tensor]  # (output, target): a tensor or a tuple of tensors each


def layer_generator(spec: ModelSpec, index: int) -> torch.Generator:
    """The random generator that initialises layer ``index`` (independent of ranks and of other layers)."""
    return torch.Generator().manual_seed(layer_seed(spec, index))


def layer_seed(spec: ModelSpec, index: int) -> int:
    """The seed of layer ``index``: a function of ``(spec.seed, index)`` alone."""
    # A large odd multiplier keeps (seed, index) pairs from colliding for any realistic sizes.
    return spec.seed * 1_000_003 + index


def uniform_parts(num_layers: int, num_parts: int) -> list[range]:
    """Cut ``num_layers`` consecutive layers into ``num_parts`` parts, sizes differing by at most one.

    The first parts get the extra layers.

    Raises:
        UserError: fewer layers than parts, or a count below 1.

    Example:
        >>> uniform_parts(5, 2)
        [range(0, 3), range(3, 5)]
    """
    if num_parts < 1:
        raise UserError(f"num_parts={num_parts} is invalid; give at least 1 part")
    if num_layers < num_parts:
        raise UserError(
            f"{num_parts} parts need at least {num_parts} layers, the model has {num_layers}; "
            "Reduce num_stages or increase num_layers"
        )
    base, extra = divmod(num_layers, num_parts)
    bounds = [0]
    for k in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [range(bounds[k], bounds[k + 1]) for k in range(num_parts)]


def loss_fn(spec: ModelSpec) -> LossFn:
    """The mean loss of a batch: MSE for the mlp, cross-entropy over all tokens for the gpt.

    Example:
        >>> float(loss_fn(ModelSpec(kind="mlp", hidden=2))(torch.ones(1, 2), torch.zeros(1, 2)))
        1.0
    """
    if spec.kind == "mlp":
        return F.mse_loss
    if spec.kind == "custom":
        return spec.custom.loss
    return _token_cross_entropy


def _token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
