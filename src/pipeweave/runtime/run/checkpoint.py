"""Checkpoints of a synchronous run: save what was trained, resume exactly where it stopped.

A checkpoint is a folder (``pipeweave train --save DIR``, resumed with ``--resume DIR``)::

    meta.json           what was trained: the model, the optimizer, the steps done, the parts and their files
    part-000-step4.pt   one file per part (torch.save): its parameters, their optimizer state, its buffers

Parameters and optimizer state are keyed by the parameter's global name
(``"<layer index>.<name in layer>"``, as in plain training), so a checkpoint
resumes on any synchronous schedule, stage count or partition of the same
model: a stage loads, from every part file that overlaps its layers, the
names of its own layers. Optimizer state is stored under torch.optim's names
(``momentum_buffer`` for SGD, ``step``, ``exp_avg`` and ``exp_avg_sq`` for
AdamW), whether it came from a torch optimizer or from the post-validated
step of ``--clip-grad-norm`` (``weights.post_validation``), so either resumes
the other. A part's persistent buffers (a custom model's batch-norm running
statistics, say) are saved and restored by name beside its parameters.

Each part is written by the rank of its first stage: the replicas of a part
(Chimera, GEMS, DualPipe, data parallelism) are equal after every update
(buffers a forward updates are the first replica's).
Every rank must see the folder (one host, or a shared file system). Part
files are named by the step they hold and rank 0 writes ``meta.json`` last,
once every part is on disk (each file under a temporary name, then renamed),
and only then removes the previous checkpoint's parts: a run that dies while
saving leaves the previous checkpoint whole.

A checkpoint never holds non-finite parameters: ``save`` checks them first,
on every rank together, and refuses in one line naming the part
(``errors.Diverged``; ``runtime.run.divergence`` stops a diverging run
before it comes to that).

Resuming continues the data with the batch after the last one trained
(batches are indexed by step), so training N steps and training k steps,
saving and resuming for N - k give the same losses and parameters.

An asynchronous run saves where its stream has drained (``runtime.stream``:
``--save-every K`` ends a stream every K steps, ``--save`` saves after the
last), so no microbatch is in flight and no stash or prediction is held;
what its policy carries to the next stream (``runtime.stage.policy.StreamCarry``)
is saved too: the updates made (``updates`` in ``meta.json``; a synchronous
run's equal its steps), PipeMare's annealing count and velocity (per part,
by parameter name), and AvgPipe's replicas, which train apart (per part, the
other replicas' parameters, buffers and optimizer state, in replica order).
Training N steps with a drain after k and training k, saving and resuming
for N - k give the same losses and parameters. Another schedule resumes
from the first replica and starts its own policy state afresh.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.errors import Diverged, UserError
from pipeweave.runtime.nonfinite import nonfinite_parts
from pipeweave.runtime.run.config import TrainConfig
from pipeweave.runtime.stage.policy import StreamCarry
from pipeweave.runtime.stage.post_validation import ValidatedOptimizer
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Placement
from pipeweave.weights.post_validation import SGD


FORMAT = "pipeweave-checkpoint/1"
META = "meta.json"
_MODEL_FIELDS = ("kind", "entry", "layers", "hidden", "vocab", "heads", "seq_len", "tie_embeddings")  # not the seed


def check(config: TrainConfig, meta: dict[str, Any]) -> None:
    """Refuse, in one line and before anything is spawned, to resume ``config`` from the checkpoint of ``meta``.

    Raises:
        UserError: a checkpoint with missing part files, or of another model or optimizer.
    """
    assert config.resume is not None
    here = {k: getattr(config.model, k) for k in _MODEL_FIELDS}
    there = {k: meta["model"].get(k) for k in _MODEL_FIELDS}
    if here != there:
        differ = ", ".join(f"{k}={there[k]!r} (this run {here[k]!r})" for k in _MODEL_FIELDS if here[k] != there[k])
        raise UserError(f"--resume {config.resume} holds another model: {differ}; give the model options it was "
                        "saved with")
    if meta["optimizer"] != config.optimizer:
        raise UserError(f"--resume {config.resume} holds {meta['optimizer']} state and this run uses "
                        f"--optimizer {config.optimizer}; give --optimizer {meta['optimizer']}")
    missing = [f for f in meta["files"] if not (Path(config.resume) / f).is_file()]
    if missing:
        raise UserError(f"--resume {config.resume} lacks {', '.join(missing)} named by its {META}; the checkpoint "
                        "is incomplete: save it again")


def read_meta(folder: str) -> dict[str, Any]:
    """The ``meta.json`` of a checkpoint folder (raises UserError, one line, where there is none)."""
    path = Path(folder) / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--resume {folder}: no checkpoint there (no {META}); give a folder written by --save") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"--resume {folder}: {META} is unreadable ({exc}); save the checkpoint again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"--resume {folder}: {META} is not a {FORMAT} checkpoint; give a folder written by --save")
    return meta


def updates(meta: dict[str, Any]) -> int:
    """A checkpoint's updates per stage (``meta.json``; a synchronous run's are its steps)."""
    return int(meta.get("updates", meta["steps"]))


# ---- save ------------------------------------------------------------------------
def save(config: TrainConfig, parts: Sequence[range], placement: Placement, workers: dict[int, StageWorker],
         rank: int, steps: int, *, carry: StreamCarry | None = None) -> None:
    """Write the checkpoint of ``steps`` trained steps to ``config.save``; every rank calls it (it synchronises).

    ``parts``: the layers of each part; ``carry``: an asynchronous run's policy state after its drained
    stream (this rank's stages).
    """
    assert config.save is not None
    check_finite(config.save, parts, placement, workers, f"step {steps} of the training")
    folder = Path(config.save)
    folder.mkdir(parents=True, exist_ok=True)
    files = [f"part-{p:03d}-step{steps}.pt" for p in range(len(parts))]
    for stage, worker in workers.items():
        replicas = placement.replicas(stage)
        if replicas[0] != stage:
            continue  # a replica: the first stage of the part writes it
        part = placement.stage_part[stage]
        saved = _stage_state(worker)
        if carry is not None:  # AvgPipe's replicas train apart (on this rank); PipeMare's velocity
            saved["replicas"] = [_stage_state(workers[other]) for other in replicas[1:]]
            if stage in carry.velocity:
                saved["velocity"] = {name: v.detach().cpu().clone() for name, v in
                                     zip(worker.named_parameters(), carry.velocity[stage])}
        _write(folder / files[part], lambda tmp: torch.save(
            {"layers": [parts[part].start, parts[part].stop], **saved}, tmp))
    dist.barrier()
    if rank == 0:
        meta = {"format": FORMAT, "steps": steps, "model": asdict(config.model), "optimizer": config.optimizer,
                "lr": config.lr, "momentum": config.momentum, "schedule": config.schedule,
                "updates": steps if carry is None else carry.updates,
                **({} if carry is None or not carry.velocity else {"annealed": carry.annealed}),
                "parts": [[r.start, r.stop] for r in parts], "files": files}
        _write(folder / META, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
        for stale in folder.glob("part-*.pt"):  # the previous checkpoint's, now replaced
            if stale.name not in files:
                stale.unlink()
    dist.barrier()  # the folder is whole before any rank goes on (and may resume from it)


def check_finite(folder: str | None, parts: Sequence[range], placement: Placement, workers: dict[int, StageWorker],
                 after: str) -> None:
    """Raise ``Diverged`` on every rank if a part's parameters are not finite (every rank calls it).

    ``folder``: the run's checkpoint folder, if any (what it holds is said); ``after``: when, for the message.
    """
    bad = nonfinite_parts(workers, placement)
    if bad:
        named = ", ".join(f"part {p} (layers {parts[p].start}-{parts[p].stop - 1})" for p in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise Diverged(f"the weights of {named}{more} are not finite after {after}; {refused(folder)}; "
                       "lower --lr or use --clip-grad-norm")


def refused(folder: str | None) -> str:
    """What a run stopped by non-finite values says of its checkpoint folder (``--save``), e.g. which step it holds."""
    said = "no checkpoint of non-finite weights was written"
    if folder is None or not (Path(folder) / META).is_file():
        return said
    try:
        return f"{said} ({folder} holds step {read_meta(folder)['steps']})"
    except UserError:
        return said


def _stage_state(worker: StageWorker) -> dict[str, Any]:
    """A stage's parameters, persistent buffers and optimizer state, by global name, on the CPU."""
    params = {name: p.detach().cpu().clone() for name, p in worker.named_parameters().items()}
    buffers = {name: b.detach().cpu().clone() for name, b in worker.module.state_dict().items()
               if name not in params}  # persistent buffers: batch norm's running statistics, ...
    return {"parameters": params, "buffers": buffers, "optimizer": optimizer_state(worker)}


def _write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def optimizer_state(worker: StageWorker) -> dict[str, dict[str, Any]]:
    """The worker's optimizer state per global parameter name, under torch.optim's names, on the CPU."""
    names = {id(p): name for name, p in worker.named_parameters().items()}
    optimizer: Any = worker.optimizer
    out: dict[str, dict[str, Any]] = {}
    if isinstance(optimizer, ValidatedOptimizer):
        inner = optimizer.step_state.optimizer
        for i, p in enumerate(optimizer.params):
            if isinstance(inner, SGD):
                buf = inner.buf.get(i)
                state = {} if buf is None else {"momentum_buffer": buf}
            elif i in inner.m:
                state = {"step": torch.tensor(float(inner.t)), "exp_avg": inner.m[i], "exp_avg_sq": inner.v[i]}
            else:
                state = {}
            if state:
                out[names[id(p)]] = state
    else:
        for p, state in optimizer.state.items():
            if state:
                out[names[id(p)]] = dict(state)
    return {name: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            for name, state in out.items()}


# ---- resume ----------------------------------------------------------------------
def load(resume: str, meta: dict[str, Any], workers: dict[int, StageWorker]) -> StreamCarry:
    """Set every local worker's parameters and optimizer state from the checkpoint in ``resume`` (``meta``: its
    ``meta.json``, read once before the run).

    Returns what an asynchronous run's next stream takes from it (``StreamCarry``; a synchronous run ignores it):
    the updates made, PipeMare's annealing count and, where saved, each local stage's velocity.
    """
    folder = Path(resume)
    files: dict[str, dict[str, Any]] = {}  # read once, whichever local stages need them
    carry = StreamCarry(updates(meta), int(meta.get("annealed", 0)))
    for stage, worker in workers.items():
        replica = worker_replica(worker, stage, workers)
        mine = worker.named_parameters()
        my_buffers = {k: v for k, v in worker.module.state_dict(keep_vars=True).items() if k not in mine}
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        states: dict[str, dict[str, Any]] = {}
        velocity: dict[str, torch.Tensor] = {}
        for (start, stop), name in zip(meta["parts"], meta["files"]):
            if stop <= worker.layer_indices.start or start >= worker.layer_indices.stop:
                continue
            if name not in files:
                files[name] = torch.load(folder / name, map_location="cpu", weights_only=True)
            saved = files[name]
            velocity.update({k: v for k, v in saved.get("velocity", {}).items() if k in mine})
            others = saved.get("replicas", [])
            if 0 < replica <= len(others):  # AvgPipe's replica i, where the checkpoint has one
                saved = others[replica - 1]
            params.update({k: v for k, v in saved["parameters"].items() if k in mine})
            buffers.update({k: v for k, v in saved.get("buffers", {}).items() if k in my_buffers})
            states.update({k: v for k, v in saved["optimizer"].items() if k in mine})
        missing = sorted((set(mine) - set(params)) | (set(my_buffers) - set(buffers)))
        if missing:
            raise UserError(f"--resume {resume} has no values for {', '.join(missing[:3])}"
                            f"{' ...' if len(missing) > 3 else ''}; save the checkpoint again")
        with torch.no_grad():
            for name, p in mine.items():
                p.copy_(params[name])
            for name, b in my_buffers.items():
                b.copy_(buffers[name])
        _load_optimizer_state(worker, states, int(meta["steps"]))
        if set(velocity) == set(mine):
            carry.velocity[stage] = [velocity[name].to(p.device) for name, p in mine.items()]
    return carry


def worker_replica(worker: StageWorker, stage: int, workers: dict[int, StageWorker]) -> int:
    """Which replica of its layers ``stage`` is among this rank's stages (0: the first, or the only one)."""
    same = sorted(s for s, w in workers.items() if w.layer_indices == worker.layer_indices)
    return same.index(stage)


def _load_optimizer_state(worker: StageWorker, states: dict[str, dict[str, Any]], steps: int) -> None:
    named = worker.named_parameters()
    optimizer: Any = worker.optimizer
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
        optimizer.state[p] = {k: v.to(p.device).clone() if isinstance(v, torch.Tensor) and k != "step" else v
                              for k, v in state.items()}
