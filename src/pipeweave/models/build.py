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
from pipeweave.models.tensor_parallel import TensorParallel, apply_plan


def build_layers(spec: ModelSpec, layer_indices: Iterable[int], tp: TensorParallel | None = None) -> list[nn.Module]:
    """Build only the layers with the given indices, each initialised from its own seed.

    Args:
        spec: the model.
        layer_indices: indices in ``range(spec.num_layers)``.
        tp: this rank's tensor-parallel group: each layer is built whole, then split
            (``models.tensor_parallel``; a custom model's by its ``tp_plan``).

    Raises:
        UserError: an index outside the model, or a TP plan naming a module the layer lacks.

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
            layer = build_custom_layer(spec.custom, index, layer_seed(spec, index))
        else:
            layer = build(spec, index, layer_generator(spec, index))
        layers.append(layer if tp is None or tp.size == 1 else _split(spec, index, layer, tp))
    return layers


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """One line if the model cannot be split over ``size`` tensor-parallel ranks (before any rank starts)."""
    if size == 1:
        return
    if spec.kind == "custom":
        if spec.custom.tp_plan is None:
            raise UserError(f"--tensor-parallel {size}: the model {spec.entry} has no tp_plan; give its LayerModel "
                            "a tp_plan (per layer, {module name: 'colwise' or 'rowwise'}), or --tensor-parallel 1")
        return
    (mlp if spec.kind == "mlp" else gpt).check_tensor_parallel(spec, size)


def _split(spec: ModelSpec, index: int, layer: nn.Module, tp: TensorParallel) -> nn.Module:
    if spec.kind == "custom":
        plan = spec.custom.tp_plan[index] if spec.custom.tp_plan is not None else None
        return layer if plan is None else apply_plan(layer, plan, tp, f"tp_plan[{index}]")
    return (mlp if spec.kind == "mlp" else gpt).parallelize(spec, layer, tp)
