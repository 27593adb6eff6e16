"""The examples in the partition modules' docstrings run (the suite's doctest paths do not cover partition/)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["problem", "balance", "memory", "methods", "pipedream", "recompute"]


@pytest.mark.parametrize("name", MODULES)
def test_examples(name: str) -> None:
    module = importlib.import_module(f"pipeweave.partition.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
