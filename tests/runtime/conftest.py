"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.plan import build_schedule, optimizer_factory


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """In-process runs on one intra-op thread.

    Tiny models: threads only add contention (8x CPU time on a loaded 2-core
    machine); and the distributed ranks run one thread each, so an in-process
    oracle on one thread reduces in the same order (AdamW normalises the
    rounding noise of a gradient that is ~0, such as an attention key bias's,
    to steps of lr's size).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def equals_reference() -> Callable[[Any, Any], None]:
    """``equals_reference(config, record)``: a run's losses and every stage's final parameters are the
    reference executor's on the same schedule (rtol 1e-5, atol 1e-6)."""

    def check(config: Any, record: Any) -> None:
        reference = run_reference(build_schedule(config), config.model, steps=config.steps,
                                  batch_size=config.batch_size, optimizer_factory=optimizer_factory(config))
        torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6)
        for rank_record in record.ranks:
            for stage, params in rank_record.parameters.items():
                for name, value in params.items():
                    torch.testing.assert_close(value, reference.stage_parameters[stage][name], rtol=1e-5,
                                               atol=1e-6)

    return check
