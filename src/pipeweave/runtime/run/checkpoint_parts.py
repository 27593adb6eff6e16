"""Checkpoints of the part-file formats (``pipeweave-checkpoint/1`` and ``/2``), read so that they still resume.

Before checkpoints went through ``torch.distributed.checkpoint``, each part
was one ``torch.save`` file written by the rank of its first stage
(``part-NNN.pt`` beside ``manifest.json`` in ``step-NNNNNN/``; the first format:
``part-NNN-stepS.pt`` beside ``meta.json`` in DIR itself)::

    {"layers": [start, stop],
     "parameters": {name: tensor}, "buffers": {name: tensor}, "optimizer": {name: {field: tensor}},
     "velocity": {name: tensor},          PipeMare, after a drained stream
     "replicas": [{"parameters": ..., "buffers": ..., "optimizer": ...}, ...]}   AvgPipe's other replicas

``read_parts`` turns the parts a rank needs into the flat keys of
``checkpoint_state``, so both formats resume through one path. Nothing
writes these formats any more; a run resumed from one saves the current format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeweave.durable import reason
from pipeweave.errors import UserError
from pipeweave.runtime.run.checkpoint_state import BUFFERS, OPTIMIZER, PARAMETERS, REPLICAS, VELOCITY
from pipeweave.runtime.stage.worker import StageWorker


def read_parts(folder: Path, meta: dict[str, Any], workers: dict[int, StageWorker]) -> dict[str, torch.Tensor]:
    """The values, under ``checkpoint_state``'s keys, of every part file that overlaps a local stage's layers."""
    values: dict[str, torch.Tensor] = {}
    for (start, stop), entry in zip(meta["parts"], meta["files"]):
        if not any(start < w.layer_indices.stop and w.layer_indices.start < stop for w in workers.values()):
            continue
        saved = _read_part(folder / entry["name"])
        values.update(_flat(saved))
        values.update({f"{VELOCITY}{name}": v for name, v in saved.get("velocity", {}).items()})
        for i, replica in enumerate(saved.get("replicas", []), start=1):
            values.update(_flat(replica, f"{REPLICAS}{i}/"))
    return values


def _flat(saved: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """A part's (or a replica's) parameters, buffers and optimizer state under flat keys."""
    flat = {f"{prefix}{PARAMETERS}{name}": v for name, v in saved["parameters"].items()}
    flat.update({f"{prefix}{BUFFERS}{name}": v for name, v in saved.get("buffers", {}).items()})
    for name, state in saved["optimizer"].items():
        flat.update(
            {
                f"{prefix}{OPTIMIZER}{name}/{field}": v if isinstance(v, torch.Tensor) else torch.tensor(v)
                for field, v in state.items()
                if v is not None
            }
        )
    return flat


def _read_part(path: Path) -> dict[str, Any]:
    """A part file's contents (tensors only: ``weights_only``); one line naming the file where it cannot be read."""
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise UserError(f"cannot read the checkpoint part {path} ({reason(exc)}); resume another checkpoint") from None
    except Exception as exc:  # noqa: BLE001 - truncated (EOFError), not a zip, or not tensors only
        raise UserError(
            f"the checkpoint part {path} is damaged or not pipeweave's ({type(exc).__name__}); resume "
            "another checkpoint"
        ) from None
    return state
