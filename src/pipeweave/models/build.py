"""Build the layers of a model (``ModelSpec``): only those asked for, each from its own seed.

A rank builds only the layers of its own stages (``runtime.stage.worker``);
a layer's initialisation depends on ``(model seed, layer index)`` alone
(``spec.layer_generator``), so a layer is the same on any rank, in any
replica and in plain training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import ModuleType

from torch import nn

from pipeweave.errors import UserError
from pipeweave.models import gpt, hf_tp, llama, mlp
from pipeweave.models.custom import build_layer as build_custom_layer
from pipeweave.models.materialise import Cut
from pipeweave.models.spec import ModelSpec, layer_generator, layer_seed
from pipeweave.models.tied import tie

FAMILIES: dict[str, ModuleType] = {"mlp": mlp, "gpt": gpt, "llama": llama}
"""The built-in models by kind: each module gives ``build_layer``, ``check_tensor_parallel`` and
``tensor_parallel_plan`` (and, a transformer, ``selective_plan``)."""


def build_layers(
    spec: ModelSpec, layer_indices: Iterable[int], cut: Callable[[int], Cut] | None = None
) -> list[nn.Module]:
    """Build only the layers with the given indices, each initialised from its own seed.

    Args:
        spec: the model.
        layer_indices: indices in ``range(spec.num_layers)``.
        cut: per layer index, how this rank splits it (its tensor-parallel shard: ``models.materialise.Cut``);
            a layer built on the meta device is split before it is materialised, and reads its slices alone.

    Raises:
        UserError: an index outside the model.

    Example:
        >>> spec = ModelSpec(kind="mlp", layers=3, hidden=8)
        >>> a, b = build_layers(spec, [1]), build_layers(spec, range(3))
        >>> bool(torch.equal(a[0].up.weight, b[1].up.weight))
        True
    """
    layer_indices = list(layer_indices)
    layers = []
    for index in layer_indices:
        if not 0 <= index < spec.num_layers:
            raise UserError(
                f"layer {index} is outside the model's {spec.num_layers} layers; give 0..{spec.num_layers - 1}"
            )
        if spec.kind == "custom":
            layers.append(build_custom_layer(spec.custom, index, layer_seed(spec, index), cut and cut(index)))
        else:
            layer = FAMILIES[spec.kind].build_layer(spec, index, layer_generator(spec, index))
            layers.append(layer if cut is None else cut(index).split(layer))
    if spec.kind == "custom" and spec.custom.tied:  # one Parameter per tied group among these layers
        model = spec.custom
        tie(model.tied, dict(zip(layer_indices, layers)), lambda k: build_custom_layer(model, k, layer_seed(spec, k)))
    return layers


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """One line if the model cannot be split over ``size`` tensor-parallel ranks (before any rank starts)."""
    if size == 1:
        return
    if spec.kind == "custom":
        hf = spec.entry is not None and spec.entry.startswith("hf:")
        if hf:  # its config alone, before the model is built
            from pipeweave.models.hf import import_transformers, model_config

            hf_tp.check_sizes(model_config(import_transformers(spec.entry), spec.entry, spec.hf_config), size)
        if spec.custom.tp_plan is None and hf:
            from pipeweave.models.hf import meta_module

            raise hf_tp.no_plan(spec.entry, size, hf_tp.untaken_style(meta_module(spec.entry, spec.hf_config)))
        if spec.custom.tp_plan is None:
            raise UserError(
                f"--tensor-parallel {size}: the model {spec.entry} has no tp_plan; give its LayerModel "
                "a tp_plan (per layer, {module name: 'colwise' or 'rowwise'}), or pipeweave.pipeline(..., "
                "tp_plan={module name pattern: style}), or --tensor-parallel 1"
            )
        return
    FAMILIES[spec.kind].check_tensor_parallel(spec, size)


def tensor_parallel_plan(spec: ModelSpec, index: int, layer: nn.Module) -> Mapping[str, str]:
    """Layer ``index``'s tensor-parallel plan (``models.tensor_parallel``): the built-in model's, or the
    custom model's ``tp_plan`` entry (empty: the layer stays whole)."""
    if spec.kind == "custom":
        plans = spec.custom.tp_plan
        return (plans[index] or {}) if plans is not None else {}
    return FAMILIES[spec.kind].tensor_parallel_plan(spec, layer)  # type: ignore[no-any-return]


def selective_plan(spec: ModelSpec, index: int, layer: nn.Module) -> tuple[str, ...]:
    """The submodules of layer ``index`` that ``--recompute selective`` replays (``sim.recompute``): a built-in
    transformer's attention core, a custom model's ``LayerModel.selective`` entry.

    Raises:
        UserError: a model that names no selective region (the mlp, a custom model without ``selective``).
    """
    check_selective(spec)
    if spec.is_transformer:
        return FAMILIES[spec.kind].selective_plan(layer)  # type: ignore[no-any-return]
    return tuple(spec.custom.selective[index] or ())


def check_selective(spec: ModelSpec) -> None:
    """One line if the model names no selective region (``selective_plan``), before any rank starts."""
    if spec.kind == "mlp":
        raise UserError(f"--recompute selective: {mlp.SELECTIVE_NONE}")
    if spec.kind == "custom" and spec.custom.selective is None:
        raise UserError(
            f"--recompute selective: the model {spec.entry} names no selective region; give its "
            "LayerModel a selective list (per layer, the submodules to replay, e.g. ['attn.core']), "
            "or --recompute full or none"
        )
