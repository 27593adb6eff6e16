"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


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
