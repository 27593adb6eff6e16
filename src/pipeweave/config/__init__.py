"""A training run's configuration: ``TrainConfig`` and its sections, each field one option.

``pipeweave train``'s flags (``config.cli``) and TOML files (``config.toml``)
are generated from these dataclasses; the package imports no torch.
"""

from pipeweave.config.model import ModelSpec
from pipeweave.config.policy import PolicyOptions, PostValidation
from pipeweave.config.run_sections import CheckpointConfig, LaunchConfig, LoggingConfig, TrainingConfig
from pipeweave.config.sections import DataConfig, MemoryConfig, ParallelConfig, PartitionConfig, ScheduleConfig
from pipeweave.config.train import TrainConfig

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LaunchConfig",
    "LoggingConfig",
    "MemoryConfig",
    "ModelSpec",
    "ParallelConfig",
    "PartitionConfig",
    "PolicyOptions",
    "PostValidation",
    "ScheduleConfig",
    "TrainConfig",
    "TrainingConfig",
]
