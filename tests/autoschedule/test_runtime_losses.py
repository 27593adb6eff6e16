"""zb-auto and zb-v-auto train exactly like 1F1B on the reference executor (same losses, same weights)."""

from __future__ import annotations

import functools

import pytest
import torch

from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.plain import TrainResult
from pipeweave.runtime.reference import run_reference
from pipeweave.schedule import generate

SPEC = ModelSpec(kind="mlp", layers=8, hidden=8)


@functools.lru_cache(maxsize=1)
def _one_f_one_b() -> TrainResult:
    return run_reference(
        generate("1f1b", num_stages=4, num_microbatches=4, num_chunks=None), SPEC, steps=3, batch_size=8
    )


@pytest.mark.parametrize("name,k", [("zb-auto", 1.0), ("zb-auto", 2.0), ("zb-v-auto", 1.0)])
def test_zb_auto_losses_equal_1f1b(name: str, k: float) -> None:
    reference = _one_f_one_b()
    searched = generate(name, num_stages=4, num_microbatches=4, activation_limit=k, time_b=2.0, time_comm=0.1)
    result = run_reference(searched, SPEC, steps=3, batch_size=8)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)
