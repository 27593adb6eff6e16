"""Checkpoints of a run: save what was trained, resume exactly where it stopped, never lose the last one.

``pipeweave train --save DIR`` writes each checkpoint to a folder of its own
in DIR, made current by an atomic rename once every rank has written its
part; the newest K are kept (``--keep-checkpoints``, default 2). ``--resume
DIR`` resumes the newest complete one (or ``DIR/step-000040``, that one);
``--resume auto`` the newest in ``--save DIR`` if there is one
(``runtime.run.checkpoint_files``: the folder, the manifest, what is
atomic, what is removed)::

    DIR/step-000060/manifest.json   what was trained: the model, the optimizer, the steps done, the run, the
                                    parts and, per part file, its bytes and sha256 (checked before any rank starts)
    DIR/step-000060/part-000.pt     one file per part (torch.save, loaded with weights_only=True): its
                                    parameters, their optimizer state, its buffers

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
(buffers a forward updates are the first replica's). Every rank must see
DIR (one host, or a shared file system). ``save`` returns the one line
saying why a checkpoint could not be written (a full disk, a permission:
the path and the OS's reason) on every rank, the previous checkpoints
kept, so that the run goes on and its record is still written.

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
is saved too: the updates made (``updates`` in the manifest; a synchronous
run's equal its steps), PipeMare's annealing count and velocity (per part,
by parameter name), and AvgPipe's replicas, which train apart (per part, the
other replicas' parameters, buffers and optimizer state, in replica order).
Training N steps with a drain after k and training k, saving and resuming
for N - k give the same losses and parameters. Another schedule resumes
from the first replica and starts its own policy state afresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.durable import reason
from pipeweave.errors import Diverged, UserError
from pipeweave.runtime.nonfinite import nonfinite_parts
from pipeweave.runtime.run import checkpoint_files
from pipeweave.runtime.run.checkpoint_files import SaveFailed
from pipeweave.runtime.run.config import TrainConfig
from pipeweave.runtime.stage.policy import StreamCarry
from pipeweave.runtime.stage.post_validation import ValidatedOptimizer
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Placement
from pipeweave.weights.post_validation import SGD


_MODEL_FIELDS = ("kind", "entry", "layers", "hidden", "vocab", "heads", "seq_len", "tie_embeddings")  # not the seed


def check(config: TrainConfig, meta: dict[str, Any]) -> None:
    """Refuse, in one line and before anything is spawned, to resume ``config`` from the checkpoint of ``meta``.

    Raises:
        UserError: a checkpoint of another model or optimizer.
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


def updates(meta: dict[str, Any]) -> int:
    """A checkpoint's updates per stage (its manifest; a synchronous run's are its steps)."""
    return int(meta.get("updates", meta["steps"]))


# ---- save ------------------------------------------------------------------------
def save(config: TrainConfig, parts: Sequence[range], placement: Placement, workers: dict[int, StageWorker],
         rank: int, steps: int, *, carry: StreamCarry | None = None, run: str = "") -> str | None:
    """Write the checkpoint of ``steps`` trained steps to ``config.save``; every rank calls it (it synchronises).

    ``parts``: the layers of each part; ``carry``: an asynchronous run's policy state after its drained
    stream (this rank's stages); ``run``: the run's id (``RunPlan.run_id``).

    Returns:
        None, or (on every rank) the one line saying why no checkpoint was written -- the path and the OS's
        reason; what this save wrote is removed and the previous checkpoints are kept.
    """
    assert config.save is not None
    check_finite(config.save, parts, placement, workers, f"step {steps} of the training")
    root = Path(config.save)
    folder = checkpoint_files.staging(root, steps)
    failure = _from_rank0(_attempt(lambda: checkpoint_files.begin(root, steps)) if rank == 0 else None)
    written, error = ({}, None) if failure else _write_parts(folder, parts, placement, workers, carry)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (written, error))  # every part is on disk, or some rank says why not
    if rank == 0:
        failure = failure or next((e for _, e in every if e), None)
        if failure is None:
            entries = {name: entry for w, _ in every for name, entry in w.items()}
            manifest = _manifest(config, parts, steps, carry, run)
            manifest["files"] = [entries[_part_file(p)] for p in range(len(parts))]
            failure = _attempt(lambda: checkpoint_files.commit(folder, manifest, config.keep_checkpoints,
                                                               config.overwrite))
        if failure is not None:
            failure += checkpoint_files.abandon(folder)
    said: str | None = _from_rank0(failure)  # the checkpoint is current (or abandoned) before any rank goes on
    return said


def _write_parts(folder: Path, parts: Sequence[range], placement: Placement, workers: dict[int, StageWorker],
                 carry: StreamCarry | None) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Write this rank's parts into ``folder``: their manifest entries by file name, or why they could not be."""
    written: dict[str, dict[str, Any]] = {}
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
        state = {"layers": [parts[part].start, parts[part].stop], **saved}
        try:
            written[_part_file(part)] = checkpoint_files.write_part(folder / _part_file(part),
                                                                    lambda f: torch.save(state, f))
        except SaveFailed as exc:
            return written, str(exc)
    return written, None


def _manifest(config: TrainConfig, parts: Sequence[range], steps: int, carry: StreamCarry | None,
              run: str) -> dict[str, Any]:
    return {"run": run, "steps": steps, "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": asdict(config.model), "optimizer": config.optimizer, "lr": config.lr,
            "momentum": config.momentum, "schedule": config.schedule,
            "updates": steps if carry is None else carry.updates,
            **({} if carry is None or not carry.velocity else {"annealed": carry.annealed}),
            "parts": [[r.start, r.stop] for r in parts]}


def _part_file(part: int) -> str:
    return f"part-{part:03d}.pt"


def _attempt(step: Callable[[], Any]) -> str | None:
    """Run ``step`` of a save; None, or its ``SaveFailed`` line."""
    try:
        step()
    except SaveFailed as exc:
        return str(exc)
    return None


def _from_rank0(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    kept = None if folder is None else checkpoint_files.newest(Path(folder))
    return said if kept is None else f"{said} ({folder} holds step {kept.steps})"


def _stage_state(worker: StageWorker) -> dict[str, Any]:
    """A stage's parameters, persistent buffers and optimizer state, by global name, on the CPU."""
    params = {name: p.detach().cpu().clone() for name, p in worker.named_parameters().items()}
    buffers = {name: b.detach().cpu().clone() for name, b in worker.module.state_dict().items()
               if name not in params}  # persistent buffers: batch norm's running statistics, ...
    return {"parameters": params, "buffers": buffers, "optimizer": optimizer_state(worker)}


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
def load(resume: str | Path, meta: dict[str, Any], workers: dict[int, StageWorker]) -> StreamCarry:
    """Set every local worker's parameters and optimizer state from the checkpoint folder ``resume`` (``meta``:
    its manifest, read and its parts verified once before the run: ``checkpoint_files.find`` and ``verify``).

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
        for (start, stop), entry in zip(meta["parts"], meta["files"]):
            if stop <= worker.layer_indices.start or start >= worker.layer_indices.stop:
                continue
            name = entry["name"]
            if name not in files:
                files[name] = _read_part(folder / name)
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


def _read_part(path: Path) -> dict[str, Any]:
    """A part file's contents (tensors only: ``weights_only``); one line naming the file where it cannot be read."""
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise UserError(f"cannot read the checkpoint part {path} ({reason(exc)}); resume another checkpoint") from None
    except Exception as exc:  # noqa: BLE001 - truncated (EOFError), not a zip, or not tensors only
        raise UserError(f"the checkpoint part {path} is damaged or not pipeweave's ({type(exc).__name__}); resume "
                        "another checkpoint") from None
    return state


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
