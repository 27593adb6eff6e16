"""Reference models for the main job: a residual MLP and a byte-level GPT, as lazy layer lists."""

from pipeweave.models.spec import ModelSpec, build_layers, layer_generator, loss_fn, uniform_parts

__all__ = ["ModelSpec", "build_layers", "layer_generator", "loss_fn", "uniform_parts"]
