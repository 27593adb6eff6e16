"""The memory profile read from the simulator matches the schedules' closed forms."""

from __future__ import annotations

import pytest

from pipeweave.errors import UserError
from pipeweave.partition import LayerCosts, MemoryProfile, PartitionContext, partition
from pipeweave.schedule import generate


@pytest.mark.parametrize(("stages", "microbatches"), [(4, 8), (4, 2), (3, 3), (1, 5)])
def test_1f1b_part_k_holds_min_d_minus_k_t(stages: int, microbatches: int) -> None:
    profile = MemoryProfile.of_schedule(generate("1f1b", num_stages=stages, num_microbatches=microbatches))
    assert profile.activations == tuple(float(min(stages - k, microbatches)) for k in range(stages))
    assert profile.weights == (1.0,) * stages and profile.one_part_per_rank


def test_gpipe_every_part_holds_all_microbatches() -> None:
    profile = MemoryProfile.of_schedule(generate("gpipe", num_stages=3, num_microbatches=5))
    assert profile.activations == (5.0, 5.0, 5.0)


def test_memory_partition_shifts_layers_off_stage_0_of_1f1b_but_not_gpipe() -> None:
    costs = LayerCosts.uniform(12)  # activation 1 and params 1 per layer
    # 1F1B, D = 4: a layer on part k costs (4 - k) + 1 weight + 1 gradient = 6, 5, 4, 3 bytes.
    # Limit 15: at most 2, 3, 3, 5 layers; the least slowest part is 4 layers: (2, 3, 3, 4).
    one_f_one_b = MemoryProfile.of_schedule(generate("1f1b", num_stages=4, num_microbatches=8), state=1.0)
    ctx = PartitionContext(memory_limit=15.0, profile=one_f_one_b)
    assert partition("memory", costs, 4, ctx).counts == (2, 3, 3, 4)
    # GPipe holds all 8 microbatches everywhere: 10 bytes per layer on every part, so the same
    # limit is out of reach, and at 30 bytes the split is even.
    gpipe = MemoryProfile.of_schedule(generate("gpipe", num_stages=4, num_microbatches=8), state=1.0)
    with pytest.raises(UserError, match=r"least any split needs \(30 bytes\)"):
        partition("memory", costs, 4, PartitionContext(memory_limit=15.0, profile=gpipe))
    assert partition("memory", costs, 4, PartitionContext(memory_limit=30.0, profile=gpipe)).counts == (3, 3, 3, 3)
