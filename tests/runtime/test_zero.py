"""ZeRO-1: each replica keeps 1/P of the optimizer state and the update is the unsharded optimizer's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeweave.runtime.replicas import _buckets
from pipeweave.runtime.run.launch import launch
from pipeweave.runtime.zero import ZeroOptimizer, pad

pytestmark = pytest.mark.distributed


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 3), (11,))]


def _step(rank: int, world: int, bucket_bytes: int) -> tuple[int, int, float]:
    """(sharded state bytes, whole state bytes, largest parameter difference) after two AdamW steps."""
    factory = lambda ps: torch.optim.AdamW(ps, lr=0.1)  # noqa: E731
    sharded, whole = _params(), _params()
    spans = _buckets(sharded, bucket_bytes)
    zero = ZeroOptimizer(factory, sharded, spans, dist.group.WORLD)
    plain = factory(whole)
    for step in range(2):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)) for i, p in
                 enumerate(whole)]
        for p, g in zip(whole, grads):
            p.grad = g.clone()
        plain.step()
        slices = []  # this rank's slice of each bucket's gradient, as the reduce-scatter would give it
        for span in spans:
            flat = pad(torch.cat([grads[i].reshape(-1) for i in span]), world)
            slices.append(flat.chunk(world)[rank].clone())
        zero.set_gradients(slices)
        zero.step()
        zero.zero_grad()
    state = sum(v.numel() * v.element_size() for s in plain.state.values() for v in s.values() if v.dim() > 0)
    diff = max(float((a - b).abs().max()) for a, b in zip(sharded, whole))
    return zero.state_bytes() - 4 * len(spans), state, diff  # less AdamW's step counter per slice (4 B)


@pytest.mark.parametrize("bucket_bytes", [10**6, 60], ids=["one-bucket", "several-buckets"])
def test_zero1_keeps_a_slice_of_the_state_and_steps_as_the_whole_optimizer(bucket_bytes: int) -> None:
    sharded, whole, diff = launch(_step, bucket_bytes, 2)
    numel = sum(p.numel() for p in _params())  # 35 + 5 + 9 + 11 = 60
    assert whole == 2 * 4 * numel  # exp_avg and exp_avg_sq of every element
    assert whole // 2 <= sharded <= whole // 2 + 2 * 4 * len(_buckets(_params(), bucket_bytes))  # half, padded
    assert diff == 0.0  # elementwise: the slice's update is bitwise the whole one's
