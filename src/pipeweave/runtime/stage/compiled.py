"""``--compile``: a stage's layers through ``torch.compile``, the split backward (I, then W) kept.

The split backward lives in the deferrable layers (``models.layers``: the
linear and embedding layers' autograd functions hand their weight gradients
to the stage's ``WeightGradStore`` at I and run them at W). Those functions
act on Python state in their backward (the store, the parameters' ``.grad``),
which a compiled graph would trace once and never run again, so they stay
eager: each deferrable module's forward is excluded from compilation
(``torch.compiler.disable``), and dynamo compiles the code between them --
normalisation, attention, activations, residual adds -- as graphs of their
own. I and W then do exactly what they do eagerly, and a compiled stage's
losses equal the eager stage's within float tolerance (the fused kernels
round differently).

Each layer is compiled in place (``nn.Module.compile``): its parameters,
their names and the checkpoints keep what they were.

Example:
    >>> from pipeweave.models.build import build_layers
    >>> from pipeweave.models.spec import ModelSpec
    >>> layers = build_layers(ModelSpec(kind="mlp", layers=2, hidden=4), [0, 1])
    >>> compile_layers(layers, backend="eager")
    >>> [type(layer).__name__ for layer in layers]
    ['MLPBlock', 'MLPBlock']
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pipeweave.models.layers import Deferrable

BACKEND = "inductor"
"""What ``--compile`` compiles with (torch.compile's default)."""


def compile_layers(layers: Iterable[nn.Module], backend: str = BACKEND) -> None:
    """Compile every layer in place with ``backend``, its deferrable modules left eager (module docstring)."""
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, Deferrable):
                module.forward = torch.compiler.disable(module.forward)  # type: ignore[no-untyped-call]
        layer.compile(backend=backend)
