"""Tied parameters of a layer list: groups of parameters that are one, by global name ``"<layer>.<name>"``.

A group is declared (``LayerModel.tied``, as DeepSpeed's ``TiedLayerSpec``)
or found (``pipeweave.pipeline``: one Parameter object used by several
parts). Layers built together in one process (``models.build``) share one
Parameter per group, so plain training trains the module as written; layers
built apart (another stage, another rank) hold copies that start equal and
whose gradients ``runtime.stage.tied`` sums before every update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from pipeweave.errors import UserError


def layer_of(name: str) -> int:
    """The layer index of a global parameter name ``"<layer>.<name in layer>"``."""
    return int(name.partition(".")[0])


def check_groups(groups: Sequence[Sequence[str]], num_layers: int) -> None:
    """One line for a group that is not a list of two or more global names of layers of the model."""
    for group in groups:
        if isinstance(group, str) or len(group) < 2:
            raise UserError(
                f"tied group {group!r} is not a list of two or more parameter names; give e.g. "
                "[['0.weight', '5.out.weight']]"
            )
        for name in group:
            head, dot, rest = str(name).partition(".")
            if not (head.isdigit() and dot and rest and int(head) < num_layers):
                raise UserError(
                    f"tied parameter {name!r} is not '<layer>.<name in layer>' with a layer below "
                    f"{num_layers}; write e.g. '0.weight'"
                )


def parameter(layer: nn.Module, name: str) -> nn.Parameter:
    """The parameter ``name`` (within the layer) of ``layer``.

    Raises:
        UserError: the layer has no such parameter.
    """
    try:
        return layer.get_parameter(name)
    except AttributeError:
        names = [n for n, _ in layer.named_parameters()][:6]
        raise UserError(
            f"tied parameter {name!r} is not a parameter of its layer; its parameters include {', '.join(names)}"
        ) from None


def tie(groups: Sequence[Sequence[str]], layers: Mapping[int, nn.Module], build: Callable[[int], nn.Module]) -> None:
    """Make the members of each group held in ``layers`` one Parameter, with the group's first member's value.

    ``build(k)`` builds layer ``k`` apart (for a first member held elsewhere).

    Raises:
        UserError: members whose shapes differ.
    """
    for group in groups:
        held = [n for n in group if layer_of(n) in layers]
        if not held:
            continue
        first = group[0]
        source = layers[layer_of(first)] if layer_of(first) in layers else build(layer_of(first))
        value = parameter(source, first.partition(".")[2])
        shared = parameter(layers[layer_of(held[0])], held[0].partition(".")[2])
        for name in held:
            mine = parameter(layers[layer_of(name)], name.partition(".")[2])
            if mine.shape != value.shape:
                raise UserError(
                    f"tied parameters {first} {tuple(value.shape)} and {name} {tuple(mine.shape)} "
                    "differ in shape; tie parameters of one shape"
                )
            _replace(layers[layer_of(name)], mine, shared)
        if shared is not value:
            with torch.no_grad():
                shared.copy_(value)


def _replace(layer: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Every reference to ``old`` among ``layer``'s modules' parameters made one to ``new``."""
    if old is new:
        return
    for module in layer.modules():
        for key, value in module._parameters.items():
            if value is old:
                module._parameters[key] = new
