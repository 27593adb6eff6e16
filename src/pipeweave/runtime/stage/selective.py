"""Selective recomputation (Korthikanti et al., MLSys 2023): replay a layer's named submodules before the backward.

``checkpoint_submodules(layers)`` wraps each submodule the model names
(``models.build.selective_plan``: the gpt's attention core) in
``torch.utils.checkpoint`` (non-reentrant): its forward keeps nothing for the
backward but its inputs, and autograd replays it when the backward first
needs one of its activations. The replay redraws the forward's random numbers
(checkpoint restores the generator state) and runs under the forward's
autocast, so gradients are plain training's. The checkpoint saves
its inputs as autograd saves tensors (its frame's ``save_inputs``), through a
stage's saved-tensor hooks: the meter (``stage.memory``) counts what the
region really holds (tests/runtime/test_recompute.py counts it by hand).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeweave.errors import UserError
from pipeweave.models.build import selective_plan
from pipeweave.models.spec import ModelSpec


def _replayed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run under a non-reentrant checkpoint when a graph is recorded, as is otherwise."""

    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False)

    return run


def checkpoint_submodules(spec: ModelSpec, layers: Iterable[tuple[int, nn.Module]]) -> int:
    """Wrap the selective submodules of each ``(index, layer)``; returns how many were wrapped.

    Raises:
        UserError: the model names no selective region, or names a submodule a layer lacks.
    """
    wrapped = 0
    for index, layer in layers:
        for name in selective_plan(spec, index, layer):
            try:
                module = layer.get_submodule(name)
            except AttributeError:
                raise UserError(
                    f"--recompute selective: layer {index} ({type(layer).__name__}) has no submodule "
                    f"{name!r}; name one of its submodules in LayerModel.selective"
                ) from None
            module.forward = _replayed(module.forward)  # type: ignore[method-assign]
            wrapped += 1
    return wrapped
