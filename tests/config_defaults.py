"""The defaults ``TrainConfig`` had before its defaults became ``pipeweave train``'s, for the tests' small runs.

``train_config(**flat)`` is ``TrainConfig`` over them: a test that sets no
schedule, model, batch, steps or optimizer runs what it always ran.
"""

from __future__ import annotations

from typing import Any

from pipeweave.config import ModelSpec, TrainConfig

LIBRARY = {
    "schedule": "1f1b",
    "model": ModelSpec(),
    "batch_size": 8,
    "steps": 10,
    "optimizer": "sgd",
    "lr": 0.1,
    "momentum": 0.0,
}


def train_config(**flat: Any) -> TrainConfig:
    """``TrainConfig(**flat)`` over ``LIBRARY``."""
    return TrainConfig(**{**LIBRARY, **flat})
