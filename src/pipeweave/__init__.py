"""pipeweave: pipeline-model-parallel schedules, simulated, searched and trained on PyTorch.

The public names are ``pipeweave.__all__``; each is imported on first use, so
``import pipeweave`` itself imports neither torch nor numpy. The schedule
registry, by name:

    >>> import pipeweave
    >>> pipeweave.SCHEDULES["1f1b"].family
    'DAPPLE / PipeDream-Flush'
    >>> isinstance(pipeweave.SCHEDULES["zb-h1"], pipeweave.ScheduleInfo)
    True
    >>> pipeweave.SCHEDULES["gpipe"].generator(num_stages=2, num_microbatches=4).num_ranks
    2

A run's configuration (``pipeweave train``'s options as fields):

    >>> config = pipeweave.TrainConfig(schedule="zb-h1", num_stages=2, num_microbatches=4)
    >>> config.schedule.num_stages, config.parallel.tensor_parallel
    (2, 1)

and ``pipeweave.train(config)`` trains it (``pipeweave.training``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC: dict[str, tuple[str, str]] = {
    "pipeline": ("pipeweave.pipelining", "pipeline"),
    "Pipeline": ("pipeweave.runtime.run.stepping", "Pipeline"),
    "train": ("pipeweave.training", "train"),
    "TrainingFailed": ("pipeweave.training", "TrainingFailed"),
    "TrainConfig": ("pipeweave.config", "TrainConfig"),
    "ModelSpec": ("pipeweave.config", "ModelSpec"),
    "ScheduleConfig": ("pipeweave.config", "ScheduleConfig"),
    "DataConfig": ("pipeweave.config", "DataConfig"),
    "ParallelConfig": ("pipeweave.config", "ParallelConfig"),
    "MemoryConfig": ("pipeweave.config", "MemoryConfig"),
    "PartitionConfig": ("pipeweave.config", "PartitionConfig"),
    "TrainingConfig": ("pipeweave.config", "TrainingConfig"),
    "PolicyOptions": ("pipeweave.config", "PolicyOptions"),
    "CheckpointConfig": ("pipeweave.config", "CheckpointConfig"),
    "LoggingConfig": ("pipeweave.config", "LoggingConfig"),
    "LaunchConfig": ("pipeweave.config", "LaunchConfig"),
    "simulate": ("pipeweave.api", "simulate"),
    "Simulation": ("pipeweave.api", "Simulation"),
    "search": ("pipeweave.api", "search"),
    "plan": ("pipeweave.api", "plan"),
    "compare": ("pipeweave.api", "compare"),
    "Comparison": ("pipeweave.api", "Comparison"),
    "SCHEDULES": ("pipeweave.schedule.registry", "SCHEDULES"),
    "ScheduleInfo": ("pipeweave.schedule.registry", "ScheduleInfo"),
    "Schedule": ("pipeweave.schedule.ir", "Schedule"),
    "CostModel": ("pipeweave.sim.cost", "CostModel"),
}
"""Public name -> (module, attribute), imported on first use (the pure packages stay torch-free)."""

__all__ = sorted(_PUBLIC)

_SUBPACKAGES = ("models",)
"""Reached as attributes too (``pipeweave.models.ModelSpec``), imported on first use."""


def __getattr__(name: str) -> object:
    """A public name (``_PUBLIC``) or a subpackage, imported on first use and kept."""
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attribute)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"pipeweave.{name}")
    else:
        raise AttributeError(f"module 'pipeweave' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBPACKAGES})
