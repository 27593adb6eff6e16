"""``pipeweave.train(config)``: ``pipeweave train`` from Python -- the same resolution, launch, record and outputs.

Example:
    >>> import tempfile, pipeweave
    >>> out = tempfile.mkdtemp()
    >>> config = pipeweave.TrainConfig(model=pipeweave.ModelSpec(kind="mlp", layers=2, hidden=8), schedule="1f1b",
    ...                                steps=2, batch_size=8, quiet=True, out=out, transport="gloo")
    >>> record = pipeweave.train(config)
    >>> len(record.losses)
    2
"""

from __future__ import annotations

from typing import Any

from pipeweave.commands.train_run import run_config
from pipeweave.config import TrainConfig
from pipeweave.runtime.process import under_torchrun
from pipeweave.runtime.run.resolve import resolve


class TrainingFailed(RuntimeError):
    """A rank of the run failed; its message went to standard error, and every rank was stopped.

    Example:
        >>> issubclass(TrainingFailed, RuntimeError)
        True
    """


def train(config: TrainConfig | None = None, **fields: Any) -> Any:
    """Train ``config`` as ``pipeweave train`` does: spawn its local ranks (or join torchrun's), show progress
    and a summary unless ``quiet``, write its record (holding its configuration), trace and plot into its ``out`` folder.

    Args:
        config: the run (default: ``pipeweave train``'s default run).
        fields: fields to change, by name (``steps=5``, ``tensor_parallel=2``).

    Returns:
        rank 0's ``RunRecord`` (``losses``, per-rank timings, memory); None on the other ranks under torchrun.

    Raises:
        UserError: a configuration that cannot run (one line, before anything is spawned).
        TrainingFailed: a rank failed (every rank is stopped; the cause is on standard error).

    Example:
        >>> import pipeweave
        >>> pipeweave.train(steps=0)
        Traceback (most recent call last):
        ...
        pipeweave.errors.UserError: --steps 0 is invalid; give an integer >= 1
    """
    config = config if config is not None else TrainConfig()
    if fields:
        config = config.replace(**fields)
    records: list[Any] = []
    code = run_config(resolve(config), on_record=records.append)
    if records:
        return records[0]
    if code != 0:
        raise TrainingFailed(f"training stopped with exit code {code}; the failing rank's cause is above")
    if not under_torchrun():
        raise TrainingFailed("training ended without a record")
    return None
