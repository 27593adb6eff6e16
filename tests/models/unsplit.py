"""The oracle of the split-module tests: plain training of the module as written, never split."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pipeweave.config import TrainConfig
from pipeweave.data import data_source, step_microbatches
from pipeweave.models import ModelSpec
from pipeweave.models.boundary import num_samples
from pipeweave.models.hf import build_module

FILE = Path(__file__).resolve().parent / "tiny_modules.py"


def unsplit_module(spec: ModelSpec) -> nn.Module:
    """The module as the model's file (or transformers) builds it, before any split."""
    if spec.entry is not None and spec.entry.startswith("hf:"):
        return build_module(spec.entry, spec.hf_config, spec.seed)
    loaded = importlib.util.spec_from_file_location("tiny_modules_unsplit", FILE)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = {
            "looped": module.Looped,
            "sequential": module.sequential_module,
            "uneven": module.Uneven,
            "routed": module.Routed,
        }[(spec.entry or "").rsplit(":")[1]]()
    return built  # type: ignore[no-any-return]


def train_unsplit(config: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain training of the unsplit module: torch's SGD, gradients accumulated over the microbatches."""
    spec = config.model
    net = unsplit_module(spec)
    loss_fn: Callable[..., torch.Tensor] = spec.custom.loss
    optimizer = torch.optim.SGD(net.parameters(), lr=config.lr)
    source = data_source(spec, batch_size=config.batch_size, min_seq_len=config.min_seq_len)
    losses = []
    for step in range(config.steps):
        total = 0.0
        for x, y in zip(*step_microbatches(source, step, config.num_microbatches)):  # cut to their lengths
            loss = loss_fn(net(x), y) * (num_samples(y) / config.batch_size)
            loss.backward()
            total += loss.item()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, dict(net.named_parameters(remove_duplicate=False))
