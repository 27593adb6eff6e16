"""ZeRO: each replica keeps 1/P of the optimizer state (stage 1) and, by FSDP2, of the parameters (stage 3), stepping as the whole optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.fsdp import FullyShardedPart, shard_stage
from pipeweave.runtime.replicas import _buckets
from pipeweave.runtime.run.checkpoint_state import stage_state
from pipeweave.runtime.run.launch import launch
from pipeweave.runtime.stage.build import build_stage, stage_options
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.zero import ZeroOptimizer, pad
from pipeweave.weights.optimizers import build_optimizer

pytestmark = pytest.mark.distributed


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 3), (11,))]


def _step_both(
    zero: ZeroOptimizer, plain: torch.optim.Optimizer, whole: list[nn.Parameter], spans: list[range], seed: int
) -> None:
    """One step of the unsharded optimizer and of ``zero``, on the same random gradients (``zero`` given this
    rank's slice of each bucket's gradient, as the reduce-scatter would give it)."""
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + i)) for i, p in enumerate(whole)]
    for p, g in zip(whole, grads):
        p.grad = g.clone()
    plain.step()
    world, rank = dist.get_world_size(), dist.get_rank()
    zero.set_gradients(
        [pad(torch.cat([grads[i].reshape(-1) for i in span]), world).chunk(world)[rank].clone() for span in spans]
    )
    zero.step()


def _step(context: RankContext, bucket_bytes: int) -> tuple[int, int, float]:
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


def _whole_state(context: RankContext, optimizer: str) -> list[str]:
    """Problems of ``whole_state``/``load_whole_state``: the gathered state is the unsharded optimizer's, and a
    fresh ZeRO optimizer loading it steps on as the unsharded one does (``optimizer`` of the registry)."""
    bucket_bytes = 60
    factory = lambda ps: build_optimizer(optimizer, ps, lr=0.1)  # noqa: E731
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


@pytest.mark.parametrize("optimizer", ["adamw", "rmsprop", "adabelief"])
def test_zero1_state_gathers_whole_and_loads_back(optimizer: str) -> None:
    assert launch(_whole_state, optimizer, 2) == []


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)


def _train(worker: StageWorker, microbatches: list[int], part: FullyShardedPart | None = None) -> None:
    """One step of ``worker`` on ``microbatches`` (seeds), each F, then I, then the deferred W (zero bubble's
    split); ``part``: FSDP's, whose reduction is driven after the last W, as ``runtime.replicas`` drives it."""
    for mb in microbatches:
        worker.forward(mb, *_data(mb))
    for mb in microbatches:
        worker.backward_input(mb, None)
    for mb in microbatches:
        worker.backward_weight(mb)
    if part is not None:
        part.reduce()
        part.finish()
    worker.update()


def _zero3(context: RankContext, _: None) -> list[str]:
    """Problems of ZeRO-3 by FSDP2 (``runtime.fsdp``) on an mlp part of 3 layers with deferred W: between actions
    each replica keeps its padded rows of every parameter; a step (F, I, W, reduce-scatter of the summed
    gradients, SGD with momentum) gives the parameters and the state of plain training on every replica's
    microbatches; a checkpoint's state read inside ``gathered()`` (even after a nested one) is whole, and values written there are kept;
    the optimizer state gathers whole and loads back."""
    rank, world = context.process, context.world
    spec, factory = ModelSpec(kind="mlp", layers=3, hidden=8), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    stage = build_stage(stage_options(spec, range(3), batch_size=6 * world, optimizer_factory=factory))
    part = shard_stage(stage, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    worker = StageWorker.from_stage(stage)
    plain = StageWorker(spec, range(3), batch_size=6 * world, optimizer_factory=factory)
    problems = []
    for step in range(2):
        _train(worker, [10 * step + 2 * rank, 10 * step + 2 * rank + 1], part)
        _train(plain, [10 * step + m for m in range(2 * world)])
    if worker.weight_bytes() != sum(-(-p.shape[0] // world) * p[0].numel() * 4 for p in plain.module.parameters()):
        problems.append(f"weight_bytes {worker.weight_bytes()}: not the padded rows")
    with worker.whole_weights():
        with worker.whole_weights():  # nested (a checkpoint's save checks finiteness inside its own)
            pass
        if any(
            not torch.allclose(a, b, rtol=1e-6, atol=1e-7)
            for a, b in zip(worker.module.parameters(), plain.module.parameters())
        ):
            problems.append("not plain training's parameters inside gathered()")
        saved = stage_state(worker)  # as a checkpoint reads them, buffers too: nothing resharded meanwhile
        if any(
            not torch.allclose(saved[f"parameters/{n}"], p, rtol=1e-6, atol=1e-7)
            for n, p in plain.named_parameters().items()
        ):
            problems.append("a checkpoint's state is not plain training's parameters")
        next(iter(worker.module.parameters())).data.fill_(7.0)  # as a checkpoint's values are loaded
    with worker.whole_weights():
        if not bool((next(iter(worker.module.parameters())) == 7.0).all()):
            problems.append("a value written inside gathered() is lost")
    state = part.whole_state(worker.optimizer)
    want = {n: plain.optimizer.state[p]["momentum_buffer"] for n, p in plain.named_parameters().items()}
    if set(state) != set(want) or any(
        not torch.allclose(state[n]["momentum_buffer"], want[n], rtol=1e-6, atol=1e-7) for n in want
    ):
        problems.append("the gathered optimizer state is not plain training's")
    part.load_whole_state(worker.optimizer, {n: {"momentum_buffer": torch.ones_like(v)} for n, v in want.items()})
    if any(not bool((s["momentum_buffer"] == 1).all()) for s in part.whole_state(worker.optimizer).values()):
        problems.append("the loaded optimizer state is not what was given")
    return problems


def test_zero3_by_fsdp2_shards_each_layer_and_steps_as_plain_training() -> None:
    assert launch(_zero3, None, 2) == []
