"""Models as lazy layer lists: the reference residual MLP, byte-level GPT and Llama, and your own (``LayerModel``)."""

from pipeweave.models.build import build_layers
from pipeweave.models.custom import LayerModel
from pipeweave.models.spec import ModelSpec, layer_generator, loss_fn, uniform_parts

__all__ = ["LayerModel", "ModelSpec", "build_layers", "layer_generator", "loss_fn", "uniform_parts"]
