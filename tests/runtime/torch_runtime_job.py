"""Train CSV schedules on torch.distributed.pipelining's own runtime (``_PipelineScheduleRuntime``), on gloo.

``python torch_runtime_job.py SPEC.json`` spawns ``world`` ranks; for each job of the spec (a CSV file, its
format, its stage -> rank map and microbatch count) every rank builds torch's ``PipelineStage`` for each
stage it holds (stage s is block s of ``model``), loads the file with ``_load_csv`` and trains ``steps``
steps of SGD; with ``fsdp`` each stage's block is sharded (FSDP2, a data-parallel group of one), so that
the file's ``UNSHARD``/``RESHARD`` actions run for real. Each rank saves ``<out>/<job>-rank<r>.pt``: its stages' final weights and, where it holds
the last stage, the per-microbatch losses of every step. No pipeweave code runs here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WIDTH, BATCH, LR = 8, 8, 0.1


def model(num_stages: int) -> nn.Sequential:
    """One block (Linear, Tanh) per stage, seeded: every rank and the reference build the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages)))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)) for _ in range(steps)]


def _train(rank: int, world: int, job: dict[str, Any], steps: int, out: Path) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    stage_rank = job["stage_rank"]
    num_stages = len(stage_rank)
    blocks = model(num_stages)
    mine = [s for s, r in enumerate(stage_rank) if r == rank]
    if job.get("fsdp"):  # each stage's block sharded (FSDP2) over a data-parallel group of one rank
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
        for s in mine:
            fully_shard(blocks[s], mesh=mesh["dp"], reshard_after_forward=True)
    stages = [PipelineStage(blocks[s], s, num_stages, torch.device("cpu")) for s in mine]
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=job["microbatches"], loss_fn=nn.functional.mse_loss)
    schedule._load_csv(job["csv"], format=job["format"])
    optimizer = torch.optim.SGD([p for s in mine for p in blocks[s].parameters()], lr=LR)
    losses: list[list[float]] = []
    for x, y in batches(steps):
        optimizer.zero_grad()
        step_losses: list[torch.Tensor] = []
        args = (x,) if 0 in mine else ()
        if num_stages - 1 in mine:
            schedule.step(*args, target=y, losses=step_losses)
            losses.append([float(v) for v in step_losses])
        else:
            schedule.step(*args)
        optimizer.step()
    state = {f"{s}.{k}": v for s in mine for k, v in blocks[s].state_dict().items()}
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
    torch.save({"losses": losses or None, "weights": weights}, out / f"{job['name']}-rank{rank}.pt")


def _rank(rank: int, spec: dict[str, Any]) -> None:
    world = spec["world"]
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    try:
        for job in spec["jobs"]:
            _train(rank, world, job, spec["steps"], Path(spec["out"]))
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)  # ranks fork from here, with torch and the pipelining package already imported
    import torch.distributed.pipelining  # noqa: F401

    config = json.loads(Path(sys.argv[1]).read_text())
    mp.start_processes(_rank, args=(config,), nprocs=config["world"], join=True, start_method="fork")
