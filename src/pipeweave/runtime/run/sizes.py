"""Sizes of a run's model, counted before it runs: bytes between layers, bytes of each part's weights.

A custom model is measured by running two samples through its layers
(``models.custom.probe``, once per model and seed in a process); the built-in
models' sizes follow from their shapes. The launcher sizes its shared-memory
rings with ``largest_message_bytes``; the report sets the measured weight
bytes beside ``part_weight_bytes`` x the simulated copies.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from pipeweave.data import data_source, split_microbatches
from pipeweave.models.custom import probe
from pipeweave.models.build import build_layers
from pipeweave.models.spec import ModelSpec, layer_seed
from pipeweave.runtime.run.config import TrainConfig
from pipeweave.schedule import Schedule


def microbatch_sizes(config: TrainConfig) -> list[int]:
    """Dimension 0 of every microbatch of a step (a stream: of every mini-batch), every replica's."""
    t = config.num_microbatches * config.data_parallel  # every replica's microbatches
    sizes = [len(m) for m in split_microbatches(torch.empty(config.batch_size, 0), t)]
    return sizes * config.steps if config.is_stream else sizes


def probe_model(spec: ModelSpec, seed: int) -> int:
    """A custom model, checked by running two samples through it: the largest bytes per sample between layers.

    Raises:
        UserError: a layer or the loss that does not fit the ``LayerModel`` contract (``models.custom.probe``).
    """
    return _probe(spec, seed)


@functools.lru_cache(maxsize=None)
def _probe(spec: ModelSpec, seed: int) -> int:
    inputs, targets = data_source(spec, batch_size=2, seed=seed).batch(0)
    return probe(spec.custom, [layer_seed(spec, k) for k in range(spec.num_layers)], inputs, targets)


def part_weight_bytes(spec: ModelSpec, parts: Sequence[range]) -> list[float]:
    """Bytes of one copy of each part's weights (M_theta), counted from the model's layers."""
    return [float(sum(p.numel() * p.element_size() for layer in build_layers(spec, list(part))
                      for p in layer.parameters())) for part in parts]


def largest_message_bytes(config: TrainConfig, schedule: Schedule, parts: Sequence[range]) -> int:
    """Bytes of the largest point-to-point message a run sends (what a shared-memory ring must hold).

    A microbatch's activation or input gradient (float32, (b, h) for the
    mlp, (b, seq, h) for the gpt, a custom model's largest as ``probe_model``
    finds it) and, where parts are replicated (Chimera, GEMS, DualPipe), a
    part's whole gradient, counted from its layers.
    """
    model = config.model
    if model.kind == "custom":
        per_sample = probe_model(model, config.seed)
    else:
        per_sample = model.hidden * (model.seq_len if model.kind == "gpt" else 1) * 4
    largest = max(microbatch_sizes(config)) * per_sample
    placement = schedule.placement
    if any(len(placement.replicas(s)) > 1 for s in range(placement.num_stages)):
        largest = max(largest, int(max(part_weight_bytes(model, parts))))  # float32, as sent
    return largest
