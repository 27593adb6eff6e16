"""Models that each rank would split its own way: what ranks measuring a model apart would choose.

Under torchrun (``RANK`` set), loading ``net`` or ``profiled`` makes this
process's profiler measure block ``HEAVY[RANK]`` as costly and every other
piece as cheap -- deterministic costs that differ by rank, as timings taken in
separate processes may -- and keep its profiles in a folder of its own
(``$PIPEWEAVE_CACHE/rank<RANK>``), as nodes with their own disks do. The model
is the same function on every rank.

- ``net``: the plain module (``--model FILE:net``, a piece per child;
  ``--partition time`` groups the 6 pieces: 2 + 4 on rank 0, 4 + 2 on rank 1);
- ``profiled``: ``pipeweave.pipeline(net, split_points=2)`` (the profiler cuts:
  before child 2 on rank 0, before child 4 on rank 1);
- ``named``: cut before child 2 on rank 0 (and in a process without a group),
  before child 3 on the others: processes that chose apart, without torchrun.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pipeweave

HEAVY = (0, 3)  # the costly block as rank 0 and as rank 1 measure it
WIDTH, VOCAB, SEQ = 16, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def Net() -> nn.Sequential:
    """The embedding (child 0), 4 blocks (children 1-4) and the head (child 5); a Sequential: no tracing."""
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *(Block() for _ in range(4)), nn.Linear(WIDTH, VOCAB))


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _measure_apart() -> None:
    """Under torchrun: this rank's profiler sees piece ``1 + HEAVY[rank]`` (block ``HEAVY[rank]``) as 100x the
    others, and caches into a folder of this rank's. Done when the model is loaded, not when pytest imports this."""
    if "RANK" not in os.environ:
        return
    from pipeweave.runtime import profile

    rank = int(os.environ["RANK"])
    cache = os.environ.get("PIPEWEAVE_CACHE")
    if cache is not None and not cache.endswith(f"rank{rank}"):
        os.environ["PIPEWEAVE_CACHE"] = os.path.join(cache, f"rank{rank}")
    measured = profile._profile_layer
    if getattr(measured, "apart", False):
        return

    def apart(spec: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        row, out = measured(spec, index, *args, **kwargs)
        cost = 1.0 if index == 1 + HEAVY[rank % 2] else 0.01
        row.update(forward=cost, input_grad=cost, weight_grad=cost)
        return row, out

    apart.apart = True  # type: ignore[attr-defined]
    profile._profile_layer = apart


def net() -> nn.Module:
    _measure_apart()
    return Net()


def profiled() -> pipeweave.models.LayerModel:
    return pipeweave.pipeline(net(), None, 2, loss=loss, dataset=dataset)


def named() -> pipeweave.models.LayerModel:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return pipeweave.pipeline(Net(), None, [str(2 + min(rank, 1))], loss=loss, dataset=dataset)


if __name__ == "__main__":  # a user's torchrun script: the group first, so rank 0 alone profiles; then the run
    from pipeweave.config import TrainConfig
    from pipeweave.models import ModelSpec
    from pipeweave.runtime.run.job import run_rank
    from pipeweave.runtime.run.launch import launch
    from pipeweave.runtime.run.prepare import prepare

    dist.init_process_group("gloo")
    config = TrainConfig(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        batch_size=4,
        steps=2,
        optimizer="sgd",
        model=ModelSpec.of(profiled),
    )
    record = launch(run_rank, prepare(config), 2)
    print(
        json.dumps({"cut at": list(config.model.custom.split_points), "losses": record and record.losses}), flush=True
    )
    dist.barrier()  # both ranks done with the group before either tears it down (gloo aborts otherwise)
    dist.destroy_process_group()
