"""Lazy construction, observed: which layers each rank of a run builds.

Every rank builds only the layers of its own stages (``StageWorker`` calls
``build_layers`` with its part's indices; a layer's initialisation depends on
``(seed, index)`` alone), so host memory per rank scales with 1/D. This module
records the layer factory's calls on every rank of a real run, for tests and
for ``--check-lazy`` style diagnostics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from pipeweave.models.build import FAMILIES
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.prepare import RunPlan
from pipeweave.runtime.run.record import RunRecord


@contextlib.contextmanager
def recording_builds(kind: str) -> Iterator[list[int]]:
    """Within the block, every layer index the ``kind`` family's factory builds is appended to the list."""
    family = FAMILIES[kind]
    factory = family.build_layer
    built: list[int] = []

    def counted(spec: Any, index: int, generator: Any) -> Any:
        built.append(index)
        return factory(spec, index, generator)

    family.build_layer = counted  # type: ignore[assignment]
    try:
        yield built
    finally:
        family.build_layer = factory  # type: ignore[assignment]


def run_rank_recording_builds(context: RankContext, plan: RunPlan) -> tuple[RunRecord, list[list[int]]] | None:
    """``run_rank``, and on rank 0 also every rank's list of the layer indices it built."""
    with recording_builds(plan.config.model.kind) as built:
        record = run_rank(context, plan)
    gathered: list[Any] | None = [None] * context.world if context.process == 0 else None
    dist.gather_object(built, gathered, dst=0)
    if context.process != 0:
        return None
    assert record is not None and gathered is not None
    return record, gathered
