"""``--save-pretrained DIR`` on the ranks: each writes its own parts' tensors as one shard (``models.export``).

Every process opens its stages' whole weights (ZeRO-3's slices gathered, a
tensor-parallel group's shards joined per tensor), then the processes agree
which of them writes each tensor: the first layer holding it (a tied group
lives on two stages; replicas hold the same layers), on the lowest stage rank,
by its ``tp`` coordinate 0. Only names are exchanged; no rank receives
another's tensors. ``commands.train_run`` joins the shards once every rank is
done (``models.export.finish``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from pipeweave.config import TrainConfig
from pipeweave.durable import reason
from pipeweave.models.export import saved_names, shard_name, write_shard
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.stage.shards import gathered
from pipeweave.runtime.stage.tensor_parallel import gather
from pipeweave.runtime.stage.worker import StageWorker


def save_parts(config: TrainConfig, context: RankContext, workers: Mapping[int, StageWorker], ranks: int) -> None:
    """Write this rank's shard of ``--save-pretrained`` (nothing without it); every process calls it.

    ``ranks``: the schedule's stage ranks (the shards' count). A shard that cannot be written is said as a
    warning; the run's end then reports the save incomplete.
    """
    folder = config.checkpoint.save_pretrained
    if folder is None:
        return
    names = saved_names(config.model.entry or "", config.model.hf_config)
    held: dict[str, tuple[int, torch.Tensor, StageWorker]] = {}
    with gathered(workers):
        for stage in sorted(workers):
            for name, param in workers[stage].named_parameters().items():
                layer, _, local = name.partition(".")
                if ".pipeweave_linear_" in name or local not in names:  # deferrable linears: the same Parameters
                    continue
                saved = names[local]
                if saved not in held or int(layer) < held[saved][0]:
                    held[saved] = (int(layer), param, workers[stage])
        whole = {k: _whole(p, w) for k, (_, p, w) in held.items()}
    rank = context.stage_rank
    claims = {k: (layer, rank) for k, (layer, _, _) in held.items()} if context.reporting else {}
    every: list[dict[str, tuple[int, int]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, claims)
    first: dict[str, tuple[int, int]] = {}
    for other in every:
        for k, claim in other.items():
            first[k] = min(first.get(k, claim), claim)
    if not context.reporting:
        return
    mine = {k: t for k, t in whole.items() if first[k] == claims[k]}
    path = Path(folder) / shard_name(rank, ranks)
    try:
        write_shard(path, mine)
    except OSError as exc:
        context.progress({"checkpoint_failed": f"--save-pretrained {folder}: cannot write {path.name} ({reason(exc)})"})


def _whole(param: torch.Tensor, worker: StageWorker) -> torch.Tensor:
    """A copy of ``param`` on the CPU, whole (its tensor-parallel shards joined)."""
    joined = param.detach() if worker.tensor_parallel is None else gather(param, worker.tensor_parallel)
    return joined.cpu().clone()
