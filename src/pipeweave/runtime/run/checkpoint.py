"""Checkpoints of a run: save what was trained, resume exactly where it stopped, never lose the last one.

``pipeweave train --save DIR`` writes each checkpoint with
``torch.distributed.checkpoint`` (DCP) into a folder of its own in DIR, made
current by an atomic rename once every rank has written its share; the newest
K are kept (``--keep-checkpoints``, default 2). ``--resume DIR`` resumes the
newest complete one (or ``DIR/step-000040``, that one); ``--resume auto`` the
newest in ``--save DIR`` if there is one (``runtime.run.checkpoint_files``:
the folder, the manifest, what is atomic, what is removed)::

    DIR/step-000060/manifest.json   what was trained: the model, the optimizer, the steps done, the run, the
                                    parts and every file of the folder with its bytes and sha256 (checked
                                    before any rank starts)
    DIR/step-000060/.metadata       DCP's index: every key's global size, dtype and place in the files
    DIR/step-000060/__0_0.distcp    DCP's data, one file per rank that had something to write
    DIR/step-000060/__1_0.distcp

Every rank contributes one flat state dict of its stages
(``runtime.run.checkpoint_state``: the keys, and the one place where a
tensor-parallel shard becomes what is saved): parameters, their optimizer
state under torch.optim's names, persistent buffers, and what an asynchronous
run carries between streams. Keys are global parameter names
(``"<layer index>.<name in layer>"``), so a checkpoint resumes on any
synchronous schedule, stage count, partition, data-parallel or
tensor-parallel degree or ZeRO stage of the same model: each rank asks DCP
for the keys of its own layers, and DCP reads
only those. The replicas of a part (data parallelism, Chimera, GEMS) give
equal values under the same keys on several ranks; DCP's save planner writes
each key once, so the files are the size of one copy whatever the replication.
Tensor-parallel shards and ZeRO-1's optimizer slices are saved whole
(``checkpoint_state``), each process loading its own shard of them.

Every rank must see DIR (one host, or a shared file system). ``save`` returns
the one line saying why a checkpoint could not be written (a full disk, a
permission: the path and the OS's reason) on every rank, the previous
checkpoints kept, so that the run goes on and its record is still written.
DCP's ``.metadata`` is a pickle (its tensors are read with ``weights_only``):
the manifest's sha256 of it is checked first, and only checkpoints one trusts
should be resumed, as with any DCP checkpoint.

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
run's equal its steps), PipeMare's annealing count (manifest) and velocity,
and AvgPipe's replicas, which train apart. Another schedule resumes from the
first replica and starts its own policy state afresh.

Checkpoints of the part-file formats written before (``part-NNN.pt``,
``pipeweave-checkpoint/2``, and the first format) still resume
(``runtime.run.checkpoint_parts``); new ones are always written with DCP.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.config import TrainConfig
from pipeweave.durable import reason
from pipeweave.errors import Diverged, UserError
from pipeweave.runtime.nonfinite import nonfinite_parts
from pipeweave.runtime.run import checkpoint_files, checkpoint_state
from pipeweave.runtime.run.checkpoint_files import SaveFailed
from pipeweave.runtime.run.checkpoint_parts import read_parts
from pipeweave.runtime.run.checkpoint_storage import read, write
from pipeweave.runtime.stage.policy import StreamCarry
from pipeweave.runtime.stage.shards import gathered
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Placement

_MODEL_FIELDS = (
    "kind",
    "entry",
    "layers",
    "hidden",
    "vocab",
    "heads",
    "seq_len",
    "tie_embeddings",
    "hf_config",
)  # not the seed


def check(config: TrainConfig, meta: dict[str, Any]) -> None:
    """Refuse, in one line and before anything is spawned, to resume ``config`` from the checkpoint of ``meta``.

    Raises:
        UserError: a checkpoint of another model or optimizer.
    """
    assert config.checkpoint.resume is not None
    here = {k: getattr(config.model, k) for k in _MODEL_FIELDS}
    there = {k: meta["model"].get(k) for k in _MODEL_FIELDS}
    if here != there:
        differ = ", ".join(f"{k}={there[k]!r} (this run {here[k]!r})" for k in _MODEL_FIELDS if here[k] != there[k])
        raise UserError(
            f"--resume {config.checkpoint.resume} holds another model: {differ}; give the model options it was "
            "saved with"
        )
    _check_data(config, meta)
    if meta["optimizer"] != config.training.optimizer:
        raise UserError(
            f"--resume {config.checkpoint.resume} holds {meta['optimizer']} state and this run uses "
            f"--optimizer {config.training.optimizer}; give --optimizer {meta['optimizer']}"
        )


_DATA_FLAGS = {"path": "--data", "data_seed": "--data-seed", "batch_size": "--batch", "min_seq_len": "--min-seq-len"}
"""What decides the data a step trains on (batches are indexed by step): a resumed run keeps them."""


def data_order(config: TrainConfig) -> dict[str, Any]:
    """The fields of ``config`` that decide which samples each step trains on (a checkpoint's ``"data"``)."""
    order = {k: getattr(config.data, k) for k in _DATA_FLAGS}
    if order["path"] is not None:
        order["path"] = str(Path(order["path"]).resolve())
    return order


def _check_data(config: TrainConfig, meta: dict[str, Any]) -> None:
    """Resuming continues the saved data order; another seed, batch or file would silently change it."""
    if "data" not in meta:  # written before checkpoints recorded it
        return
    here, there = data_order(config), meta["data"]
    differ = [k for k in _DATA_FLAGS if here[k] != there.get(k)]
    if differ:

        def said(values: dict[str, Any]) -> str:
            return ", ".join(
                f"{_DATA_FLAGS[k]} {values.get(k)}" if values.get(k) is not None else f"no {_DATA_FLAGS[k]}"
                for k in differ
            )

        fix = " ".join(f"{_DATA_FLAGS[k]} {there[k]}" for k in differ if there.get(k) is not None)
        drop = " ".join(_DATA_FLAGS[k] for k in differ if there.get(k) is None)
        raise UserError(
            f"--resume {config.checkpoint.resume} continues the data of a run with {said(there)} and this run has "
            f"{said(here)} (a step's batch depends on them); "
            + " and ".join(x for x in (fix and f"give {fix}", drop and f"drop {drop}") if x)
            + (" (--data-seed sets the data order apart from --seed)" if "data_seed" in differ else "")
        )


def updates(meta: dict[str, Any]) -> int:
    """A checkpoint's updates per stage (its manifest; a synchronous run's are its steps)."""
    return int(meta.get("updates", meta["steps"]))


# ---- save ------------------------------------------------------------------------
def save(
    config: TrainConfig,
    parts: Sequence[range],
    placement: Placement,
    workers: dict[int, StageWorker],
    steps: int,
    *,
    carry: StreamCarry | None = None,
    run: str = "",
    loss_scale: dict[str, Any] | None = None,
) -> str | None:
    """Write the checkpoint of ``steps`` trained steps to ``config.checkpoint.save``; every process calls it (it synchronises).

    ``parts``: the layers of each part; ``workers``: this process's stages; ``carry``: an asynchronous run's
    policy state after its drained stream (this process's stages); ``run``: the run's id (``RunPlan.run_id``);
    ``loss_scale``: ``--precision fp16``'s scale and growth counter (``LossScale.state_dict``, the same on every
    process), kept in the manifest.
    Process 0 of the default group (not stage rank 0: the N processes of a tensor-parallel group share one)
    creates the staging folder and commits it.

    Returns:
        None, or (on every rank) the one line saying why no checkpoint was written -- the path and the OS's
        reason; what this save wrote is removed and the previous checkpoints are kept.
    """
    assert config.checkpoint.save is not None
    with gathered(workers):  # ZeRO-3's parameters whole while they are checked and written
        return _save(config, parts, placement, workers, steps, carry, run, loss_scale)


def _save(
    config: TrainConfig,
    parts: Sequence[range],
    placement: Placement,
    workers: dict[int, StageWorker],
    steps: int,
    carry: StreamCarry | None,
    run: str,
    loss_scale: dict[str, Any] | None = None,
) -> str | None:
    assert config.checkpoint.save is not None
    check_finite(config.checkpoint.save, parts, placement, workers, f"step {steps} of the training")
    root = Path(config.checkpoint.save)
    folder = checkpoint_files.staging(root, steps)
    process = dist.get_rank()
    failure = _from_rank0(_attempt(lambda: checkpoint_files.begin(root, steps)) if process == 0 else None)
    own = False  # whether this rank's own write is what failed (its line names the file and the OS's reason)
    if failure is None:  # DCP's save is collective: a rank that cannot write fails it on every rank
        failure, own = write(folder, checkpoint_state.rank_state(placement, workers, carry))
    written, error = ([], failure) if failure else _describe(folder, process)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (written, error, own or (error is not None and failure is None)))
    if process == 0:  # every file is on disk and hashed, or some rank says why not (one whose own write failed first)
        failure = next((e for _, e, _ in sorted(every, key=lambda said: not said[2]) if e), None)
        if failure is None:
            manifest = _manifest(config, parts, steps, carry, run)
            if loss_scale is not None:
                manifest["loss_scale"] = loss_scale
            manifest["files"] = sorted((entry for w, _, _ in every for entry in w), key=lambda e: e["name"])
            failure = _attempt(
                lambda: checkpoint_files.commit(
                    folder, manifest, config.checkpoint.keep_checkpoints, config.checkpoint.overwrite
                )
            )
        if failure is not None:
            failure += checkpoint_files.abandon(folder)
    said: str | None = _from_rank0(failure)  # the checkpoint is current (or abandoned) before any rank goes on
    return said


def _describe(folder: Path, process: int) -> tuple[list[dict[str, Any]], str | None]:
    """This process's share of the manifest's file list: every world-th file of ``folder``, hashed (or why not)."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    try:
        return [checkpoint_files.describe(folder / name) for name in names[process :: dist.get_world_size()]], None
    except OSError as exc:
        return [], f"cannot read {exc.filename or folder}: {reason(exc)}"


def _manifest(
    config: TrainConfig, parts: Sequence[range], steps: int, carry: StreamCarry | None, run: str
) -> dict[str, Any]:
    return {
        "run": run,
        "steps": steps,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": asdict(config.model),
        "data": data_order(config),
        "optimizer": config.training.optimizer,
        "lr": config.training.lr,
        "momentum": config.training.momentum,
        "schedule": config.schedule.name,
        "data_parallel": config.parallel.data_parallel,
        "updates": steps if carry is None else carry.updates,
        **({} if carry is None or not carry.velocity else {"annealed": carry.annealed}),
        "parts": [[r.start, r.stop] for r in parts],
        "writer": f"torch.distributed.checkpoint {torch.__version__}",
    }


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


def check_finite(
    folder: str | None, parts: Sequence[range], placement: Placement, workers: dict[int, StageWorker], after: str
) -> None:
    """Raise ``Diverged`` on every rank if a part's parameters are not finite (every rank calls it).

    ``folder``: the run's checkpoint folder, if any (what it holds is said); ``after``: when, for the message.
    """
    bad = nonfinite_parts(workers, placement)
    if bad:
        named = ", ".join(f"part {p} (layers {parts[p].start}-{parts[p].stop - 1})" for p in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise Diverged(
            f"the weights of {named}{more} are not finite after {after}; {refused(folder)}; "
            "lower --lr or use --clip-grad-norm"
        )


def refused(folder: str | None) -> str:
    """What a run stopped by non-finite values says of its checkpoint folder (``--save``), e.g. which step it holds."""
    said = "no checkpoint of non-finite weights was written"
    kept = None if folder is None else checkpoint_files.newest(Path(folder))
    return said if kept is None else f"{said} ({folder} holds step {kept.steps})"


# ---- resume ----------------------------------------------------------------------
def load(
    resume: str | Path, meta: dict[str, Any], workers: dict[int, StageWorker], apart: dict[int, int] | None = None
) -> StreamCarry:
    """Set every local worker's parameters, buffers and optimizer state from the checkpoint folder ``resume``
    (``meta``: its manifest, read and its files verified once before the run: ``checkpoint_files.find`` and
    ``verify``). Every rank calls it: DCP's load is collective; each rank reads the keys of its own layers.

    Returns what an asynchronous run's next stream takes from it (``StreamCarry``; a synchronous run ignores it):
    the updates made, PipeMare's annealing count and, where saved, each local stage's velocity. ``apart``: AvgPipe's
    replicas on ranks of their own, each read from its own keys (``checkpoint_state.apart_replicas``).
    """
    with gathered(workers):  # ZeRO-3: whole parameters to load into; their slices taken again before freed
        return _load(Path(resume), meta, workers, apart)


def _load(
    folder: Path, meta: dict[str, Any], workers: dict[int, StageWorker], apart: dict[int, int] | None
) -> StreamCarry:
    if meta.get("format") == checkpoint_files.FORMAT:
        values = read(folder, lambda saved: checkpoint_state.destinations(saved, workers, str(folder), apart))
    else:  # a checkpoint of part files, written before DCP
        values = read_parts(folder, meta, workers)
    carry = StreamCarry(updates(meta), int(meta.get("annealed", 0)))
    carry.velocity = checkpoint_state.apply(values, workers, int(meta["steps"]), str(folder), apart)
    return carry
