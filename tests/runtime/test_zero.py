"""ZeRO: each replica keeps 1/P of the optimizer state (stage 1) and of the parameters (stage 3), stepping as the whole optimizer."""

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


def _step_both(zero: ZeroOptimizer, plain: torch.optim.Optimizer, whole: list[nn.Parameter], spans: list[range],
               seed: int) -> None:
    """One step of the unsharded optimizer and of ``zero``, on the same random gradients (``zero`` given this
    rank's slice of each bucket's gradient, as the reduce-scatter would give it)."""
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + i)) for i, p in enumerate(whole)]
    for p, g in zip(whole, grads):
        p.grad = g.clone()
    plain.step()
    world, rank = dist.get_world_size(), dist.get_rank()
    zero.set_gradients([pad(torch.cat([grads[i].reshape(-1) for i in span]), world).chunk(world)[rank].clone()
                        for span in spans])
    zero.step()


def _step(rank: int, world: int, bucket_bytes: int) -> tuple[int, int, float]:
    """(sharded state bytes, whole state bytes, largest parameter difference) after two AdamW steps."""
    factory = lambda ps: torch.optim.AdamW(ps, lr=0.1)  # noqa: E731
    sharded, whole = _params(), _params()
    spans = _buckets(sharded, bucket_bytes)
    zero = ZeroOptimizer(factory, sharded, spans, dist.group.WORLD)
    plain = factory(whole)
    for step in range(2):
        _step_both(zero, plain, whole, spans, 10 * step)
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


def _whole_state(rank: int, world: int, bucket_bytes: int) -> list[str]:
    """Problems of ``whole_state``/``load_whole_state``: the gathered state is the unsharded optimizer's, and a
    fresh ZeRO optimizer loading it steps on as the unsharded one does."""
    factory = lambda ps: torch.optim.AdamW(ps, lr=0.1)  # noqa: E731
    sharded, whole = _params(), _params()
    spans = _buckets(sharded, bucket_bytes)
    zero, plain = ZeroOptimizer(factory, sharded, spans, dist.group.WORLD), factory(whole)

    _step_both(zero, plain, whole, spans, 0)
    problems = []
    for i, (p, state) in enumerate(zip(whole, zero.whole_state())):
        for key, value in plain.state[p].items():
            if not torch.equal(state[key], value):
                problems.append(f"param {i} {key}")
    fresh = ZeroOptimizer(factory, sharded, spans, dist.group.WORLD)
    fresh.load_whole_state(zero.whole_state())
    _step_both(fresh, plain, whole, spans, 100)
    if any(not torch.equal(a, b) for a, b in zip(sharded, whole)):
        problems.append("the resumed step differs")
    return problems


def test_zero1_state_gathers_whole_and_loads_back() -> None:
    assert launch(_whole_state, 60, 2) == []


def _zero3(rank: int, world: int, bucket_bytes: int) -> list[str]:
    """Problems of stage 3: parameters freed between uses, whole (and equal to the unsharded optimizer's after a
    step) inside ``gathered()``, which nests."""
    factory = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    sharded, whole = _params(), _params()
    spans = _buckets(sharded, bucket_bytes)
    zero, plain = ZeroOptimizer(factory, sharded, spans, dist.group.WORLD, stage=3), factory(whole)
    problems = []
    freed = lambda: all(p.untyped_storage().nbytes() == 0 for p in sharded)  # noqa: E731
    if not freed():
        problems.append("not freed after construction")
    for step in range(2):
        _step_both(zero, plain, whole, spans, 10 * step)
        if not freed():
            problems.append(f"step {step}: whole after the step")
        with zero.gathered():
            with zero.gathered():
                pass
            if freed() or any(not torch.equal(a, b) for a, b in zip(sharded, whole)):
                problems.append(f"step {step}: not the unsharded optimizer's parameters inside gathered()")
        if not freed():
            problems.append(f"step {step}: not freed after gathered()")
    if zero.weight_bytes() != sum(s.numel() * 4 for s in zero.shards) or 2 * zero.weight_bytes() < 4 * 60:
        problems.append(f"weight_bytes {zero.weight_bytes()}: not one slice per bucket")
    return problems


@pytest.mark.parametrize("bucket_bytes", [10**6, 60], ids=["one-bucket", "several-buckets"])
def test_zero3_frees_the_parameters_between_uses_and_gathers_the_stepped_ones(bucket_bytes: int) -> None:
    assert launch(_zero3, bucket_bytes, 2) == []
