"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


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


@pytest.fixture
def checkpoint_tensors(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], dict[str, torch.Tensor]]:
    """Reads every key of a checkpoint folder (``parameters/0.up.weight``, ...) with DCP's own converter, which
    writes them into one torch.save file, loaded here with ``weights_only``."""

    def read(folder: Path) -> dict[str, torch.Tensor]:
        whole = tmp_path_factory.mktemp("whole") / "whole.pt"
        dcp_to_torch_save(folder, whole)
        return dict(torch.load(whole, weights_only=True))

    return read
