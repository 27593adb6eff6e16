"""A rank's stages as one flat state dict: what ``torch.distributed.checkpoint`` saves and loads for it.

Keys (``<name>``: a parameter's or buffer's global name ``"<layer index>.<name in layer>"``,
as in plain training)::

    parameters/<name>            a parameter
    optimizer/<name>/<field>     its optimizer state under torch.optim's names: momentum_buffer (SGD),
                                 step, exp_avg, exp_avg_sq (AdamW), whether a torch optimizer or the
                                 post-validated step of --clip-grad-norm held it
    buffers/<name>               a persistent buffer (a custom model's batch-norm statistics, say)
    velocity/<name>              PipeMare's velocity, carried from one stream to the next
    replicas/<i>/...             AvgPipe's i-th replica of the layers on its rank (i >= 1), which trains
                                 apart: the same keys again under this prefix

Keys name layers, never stages or ranks, so a rank asks a checkpoint for the
keys of its own layers whatever the partition, stage count, data-parallel
degree or schedule that wrote it (``destinations``). The replicas of a part on
other ranks (data parallelism, Chimera, GEMS) give the same parameter and
optimizer keys with equal values, and DCP's save planner writes each key once
(``torch.distributed.checkpoint._dedup_save_plans``: the rank with the least
planned so far keeps it). Buffers come from the first replica only: a forward
may update them, so replicas may differ.

Tensor parallelism: ``_saved`` is the one place a stage's tensor becomes what
is saved: ``stage_state`` and ``rank_state`` pass every parameter, optimizer
state and velocity through it, and ``destinations`` makes the load targets
from what it returns. A tensor-parallel shard is saved whole: the N processes
of its group gather it (``stage.tensor_parallel.gather``) and give the same
key with equal values, which DCP writes once, as it does a data-parallel
replica's; a loading process reads the whole tensor and keeps its own shard
(``_local``), so a checkpoint resumes at any tensor-parallel degree, 1
included. (The cost: a process holds one whole tensor of its stage at a time
while saving, and its stage's whole tensors while loading. DCP could instead
write each shard once as ``DTensor.from_local(shard, tp_mesh, [Shard(dim)])``
-- column-parallel rows on dim 0, row-parallel columns on dim 1, the fused
QKV viewed as ``(3, width, in)`` on dim 1 -- and reshard on load.)

ZeRO-1 and 2 (``runtime.zero``) and ZeRO-3 (``runtime.fsdp``): the optimizer state
of a part (at 3 its parameters too) is sharded over its replicas;
``optimizer_state`` gathers it whole per parameter (every replica calls it,
as every rank saves; the parameters are whole inside the checkpoint's
``gathered``), so a checkpoint holds the same keys at every ZeRO stage, and
each resumes the others. Buffers are read as ``named_buffers`` (the
persistent ones), never through ``state_dict()``, whose FSDP hook would free
the gathered parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from pipeweave.errors import UserError
from pipeweave.runtime.fsdp import FullyShardedPart
from pipeweave.runtime.stage.policy import StreamCarry
from pipeweave.runtime.stage.post_validation import ValidatedOptimizer
from pipeweave.runtime.stage.tensor_parallel import gather, shard
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.zero import ZeroOptimizer
from pipeweave.schedule.ir import Placement
from pipeweave.weights.post_validation import SGD

PARAMETERS, OPTIMIZER, BUFFERS, VELOCITY, REPLICAS = "parameters/", "optimizer/", "buffers/", "velocity/", "replicas/"


def _saved(worker: StageWorker, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel hook (module docstring): ``tensor`` -- the worker's parameter ``name``, or a tensor
    of that parameter's: its optimizer state, its velocity -- as it is saved: whole (a shard is gathered from
    its group, every process of which calls this); a whole one, or one of another shape (AdamW's 0-d
    ``step``), as it is."""
    tp = worker.tensor_parallel
    if tp is None or tp.size == 1:
        return tensor.detach()
    return gather(tensor, tp, like=worker.named_parameters()[name])


def _local(worker: StageWorker, name: str, value: torch.Tensor) -> torch.Tensor:
    """What ``_saved`` made, loaded: this process's shard of it (``value`` itself without tensor parallelism)."""
    tp = worker.tensor_parallel
    if tp is None or tp.size == 1:
        return value
    return shard(value, worker.named_parameters()[name], tp.rank)


# ---- save ------------------------------------------------------------------------
def rank_state(placement: Placement, workers: dict[int, StageWorker], carry: StreamCarry | None) -> dict[str, Any]:
    """This rank's share of a checkpoint: every local stage's state under global keys (every rank calls it).

    ``carry``: an asynchronous run's policy state after its drained stream (PipeMare's velocity; with it,
    AvgPipe's local replicas are saved apart, as they train apart).
    """
    state: dict[str, Any] = {}
    apart = apart_replicas(placement, workers) if carry is not None else {}
    for stage, worker in workers.items():
        replica = apart.get(stage, worker_replica(worker, stage, workers))
        if replica and carry is None:
            continue  # a second copy of these layers on this rank: equal values, the same keys
        prefix = f"{REPLICAS}{replica}/" if replica else ""
        state.update(stage_state(worker, prefix, buffers=bool(replica) or placement.replicas(stage)[0] == stage))
        if carry is not None and stage in carry.velocity:
            state.update(
                {
                    f"{prefix}{VELOCITY}{name}": _saved(worker, name, v)
                    for name, v in zip(worker.named_parameters(), carry.velocity[stage])
                }
            )
    return state


def stage_state(worker: StageWorker, prefix: str = "", *, buffers: bool = True) -> dict[str, torch.Tensor]:
    """One stage's parameters, optimizer state and (``buffers``) persistent buffers under global keys.

    Example (a stage holding layer 2 of the mlp, before its first step: no optimizer state yet)::

        worker = StageWorker(ModelSpec(kind="mlp", layers=4, hidden=8), range(2, 3), batch_size=8)
        sorted(stage_state(worker))  # ['parameters/2.down.bias', 'parameters/2.down.weight', ...]
    """
    params = worker.named_parameters()
    state = {f"{prefix}{PARAMETERS}{name}": _saved(worker, name, p) for name, p in params.items()}
    for name, fields in optimizer_state(worker).items():
        state.update({f"{prefix}{OPTIMIZER}{name}/{field}": _saved(worker, name, v) for field, v in fields.items()})
    if buffers:
        state.update({f"{prefix}{BUFFERS}{name}": b.detach() for name, b in persistent_buffers(worker).items()})
    return state


def optimizer_state(worker: StageWorker) -> dict[str, dict[str, torch.Tensor]]:
    """The worker's optimizer state per global parameter name, under torch.optim's names, tensors only
    (a number becomes a 0-d tensor, so that loading needs no pickle; a None momentum buffer is left out)."""
    names = {id(p): name for name, p in worker.named_parameters().items()}
    optimizer: Any = worker.optimizer
    out: dict[str, dict[str, Any]] = {}
    if isinstance(worker.shards, FullyShardedPart):  # its rows gathered whole: a collective of the replicas
        out = worker.shards.whole_state(optimizer)
    elif isinstance(optimizer, ZeroOptimizer):  # its slices gathered whole: a collective of the replicas
        params = list(worker.module.parameters())
        out = {names[id(p)]: state for p, state in zip(params, optimizer.whole_state())}
    elif isinstance(optimizer, ValidatedOptimizer):
        inner = optimizer.step_state.optimizer
        for i, p in enumerate(optimizer.params):
            if isinstance(inner, SGD):
                out[names[id(p)]] = {"momentum_buffer": inner.buf.get(i)}
            elif i in inner.m:
                out[names[id(p)]] = {
                    "step": torch.tensor(float(inner.t)),
                    "exp_avg": inner.m[i],
                    "exp_avg_sq": inner.v[i],
                }
    else:
        out = {names[id(p)]: dict(state) for p, state in optimizer.state.items()}
    tensors = {
        name: {
            k: v.detach() if isinstance(v, torch.Tensor) else torch.tensor(v) for k, v in state.items() if v is not None
        }
        for name, state in out.items()
    }
    return {name: state for name, state in tensors.items() if state}


def persistent_buffers(worker: StageWorker) -> dict[str, torch.Tensor]:
    """The worker's persistent buffers by global name: what ``state_dict()`` holds besides the parameters."""
    return {
        f"{prefix}{'.' if prefix else ''}{name}": b
        for prefix, module in worker.module.named_modules()
        for name, b in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set
    }


# ---- load ------------------------------------------------------------------------
def destinations(
    saved: Mapping[str, tuple[torch.Size, torch.dtype]],
    workers: dict[int, StageWorker],
    resume: str,
    apart: Mapping[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """What this rank reads of a checkpoint holding ``saved`` (key -> global size and dtype): a fresh tensor for
    every key of its stages' layers, shaped as the stage's own (``_saved`` of it), to load into.

    ``apart``: replicas that train apart on ranks of their own (``apart_replicas``).

    Raises:
        UserError: the checkpoint ``resume`` holds one of them in another shape (another model).
    """
    wanted: dict[str, torch.Tensor] = {}
    for stage, worker in workers.items():
        prefix = _prefix(worker, stage, workers, saved, apart)
        own = stage_state(worker, prefix)
        for key, template in own.items():
            if key in saved and saved[key][0] != template.shape:
                raise UserError(
                    f"--resume {resume} holds {key} of shape {list(saved[key][0])} and this model's is "
                    f"{list(template.shape)}; resume with the model it was saved with"
                )
            if key in saved:
                wanted.setdefault(key, torch.empty_like(template))
        like = {name: own[f"{prefix}{PARAMETERS}{name}"] for name in worker.named_parameters()}
        for key, (size, dtype) in saved.items():
            name = _parameter_of(key, prefix)
            if name in like and key not in wanted:
                template = like[name]
                wanted[key] = (
                    torch.empty_like(template)
                    if size == template.shape and dtype == template.dtype
                    else torch.empty(size, dtype=dtype)
                )
    return wanted


def _parameter_of(key: str, prefix: str) -> str | None:
    """The parameter an optimizer state or velocity key under ``prefix`` belongs to (None: another kind of key)."""
    if key.startswith(f"{prefix}{OPTIMIZER}"):
        return key[len(prefix) + len(OPTIMIZER) :].rpartition("/")[0]
    if key.startswith(f"{prefix}{VELOCITY}"):
        return key[len(prefix) + len(VELOCITY) :]
    return None


def apply(
    values: Mapping[str, torch.Tensor],
    workers: dict[int, StageWorker],
    steps: int,
    resume: str,
    apart: Mapping[int, int] | None = None,
) -> dict[int, list[torch.Tensor]]:
    """Set every local stage's parameters, buffers and optimizer state from ``values`` (keys as saved; ``steps``:
    the checkpoint's). Returns each stage's PipeMare velocity, where the checkpoint has one.

    Raises:
        UserError: a parameter or buffer of a local stage is not in the checkpoint (``resume`` names it).
    """
    velocities: dict[int, list[torch.Tensor]] = {}
    for stage, worker in workers.items():
        prefix = _prefix(worker, stage, workers, values, apart)
        mine = worker.named_parameters()
        my_buffers = persistent_buffers(worker)
        wanted = [f"{prefix}{PARAMETERS}{n}" for n in mine] + [f"{prefix}{BUFFERS}{n}" for n in my_buffers]
        missing = [key.removeprefix(prefix).partition("/")[2] for key in wanted if key not in values]
        if missing:
            raise UserError(
                f"--resume {resume} has no values for {', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''}; save the checkpoint again"
            )
        with torch.no_grad():
            for name, p in mine.items():
                p.copy_(_local(worker, name, values[f"{prefix}{PARAMETERS}{name}"]))
            for name, b in my_buffers.items():
                b.copy_(values[f"{prefix}{BUFFERS}{name}"])
        states: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in values.items():
            owner = _parameter_of(key, prefix) if key.startswith(f"{prefix}{OPTIMIZER}") else None
            if owner is not None and owner in mine:
                states.setdefault(owner, {})[key.rpartition("/")[2]] = _local(worker, owner, value)
        load_optimizer_state(worker, states, steps)
        velocity = [values.get(f"{prefix}{VELOCITY}{name}") for name in mine]
        if all(v is not None for v in velocity):
            velocities[stage] = [
                _local(worker, n, v).to(p.device) for v, (n, p) in zip(velocity, mine.items()) if v is not None
            ]
    return velocities


def _prefix(
    worker: StageWorker,
    stage: int,
    workers: dict[int, StageWorker],
    saved: Mapping[str, Any],
    apart: Mapping[int, int] | None = None,
) -> str:
    """Where ``stage``'s values are among ``saved``: its AvgPipe replica's keys where the checkpoint has them,
    else the first replica's (another schedule resumes from the first replica)."""
    replica = (apart or {}).get(stage, worker_replica(worker, stage, workers))
    first = next(iter(worker.named_parameters()), None)
    prefix = f"{REPLICAS}{replica}/"
    return prefix if replica and f"{prefix}{PARAMETERS}{first}" in saved else ""


def apart_replicas(placement: Placement, stages: Iterable[int]) -> dict[int, int]:
    """Per stage of ``stages`` whose part has replicas on several ranks, its place among them: AvgPipe's pipelines
    on ranks of their own train apart and save apart (``replicas/<i>/``), like its replicas sharing a rank."""
    out = {}
    for stage in stages:
        replicas = placement.replicas(stage)
        if len({placement.stage_rank[s] for s in replicas}) > 1:
            out[stage] = replicas.index(stage)
    return out


def worker_replica(worker: StageWorker, stage: int, workers: dict[int, StageWorker]) -> int:
    """Which replica of its layers ``stage`` is among this rank's stages (0: the first, or the only one)."""
    same = sorted(s for s, w in workers.items() if w.layer_indices == worker.layer_indices)
    return same.index(stage)


def load_optimizer_state(worker: StageWorker, states: dict[str, dict[str, torch.Tensor]], steps: int) -> None:
    """Set the worker's optimizer state from ``states`` (per global parameter name, torch.optim's names)."""
    named = worker.named_parameters()
    optimizer: Any = worker.optimizer
    if isinstance(worker.shards, FullyShardedPart):  # each replica keeps its rows
        worker.shards.load_whole_state(optimizer, states)
        return
    if isinstance(optimizer, ZeroOptimizer):  # each replica keeps its slices
        names = {id(p): name for name, p in named.items()}
        optimizer.load_whole_state([states.get(names[id(p)], {}) for p in worker.module.parameters()])
        optimizer.refresh()  # the parameters were just loaded: its slices of them too
        return
    if isinstance(optimizer, ValidatedOptimizer):
        inner = optimizer.step_state.optimizer
        index = {id(p): i for i, p in enumerate(optimizer.params)}
        for name, state in states.items():
            p, i = named[name], index[id(named[name])]
            if isinstance(inner, SGD):
                if "momentum_buffer" in state:
                    inner.buf[i] = state["momentum_buffer"].to(p.device).clone()
            elif "exp_avg" in state:
                inner.m[i] = state["exp_avg"].to(p.device).clone()
                inner.v[i] = state["exp_avg_sq"].to(p.device).clone()
                inner.t = int(state["step"])
        optimizer.step_state.steps = steps
        return
    for name, state in states.items():
        p = named[name]
        optimizer.state[p] = {k: v.to(p.device).clone() if k != "step" else v.clone() for k, v in state.items()}
