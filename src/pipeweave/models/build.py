"""Build the layers of a model (``ModelSpec``): only those asked for, each from its own seed.

A rank builds only the layers of its own stages (``runtime.stage.worker``);
a layer's initialisation depends on ``(model seed, layer index)`` alone
(``spec.layer_generator``), so a layer is the same on any rank, in any
replica and in plain training.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from pipeweave.errors import UserError
from pipeweave.models import gpt, mlp
from pipeweave.models.custom import build_layer as build_custom_layer
from pipeweave.models.spec import ModelSpec, layer_generator, layer_seed


def build_layers(spec: ModelSpec, layer_indices: Iterable[int]) -> list[nn.Module]:
    """Build only the layers with the given indices, each initialised from its own seed.

    Args:
        spec: the model.
        layer_indices: indices in ``range(spec.num_layers)``.

    Raises:
        UserError: an index outside the model.

    Example:
        >>> spec = ModelSpec(kind="mlp", layers=3, hidden=8)
        >>> a, b = build_layers(spec, [1]), build_layers(spec, range(3))
        >>> bool(torch.equal(a[0].up.weight, b[1].up.weight))
        True
    """
    build = mlp.build_layer if spec.kind == "mlp" else gpt.build_layer
    layers = []
    for index in layer_indices:
        if not 0 <= index < spec.num_layers:
            raise UserError(f"layer {index} is outside the model's {spec.num_layers} layers; give 0..{spec.num_layers - 1}")
        if spec.kind == "custom":
            layers.append(build_custom_layer(spec.custom, index, layer_seed(spec, index)))
        else:
            layers.append(build(spec, index, layer_generator(spec, index)))
    return layers
