"""``--model hf:PATH``: a folder written by ``save_pretrained``, its weights read by each rank for its parts alone.

The folder holds ``config.json`` and the weights as safetensors: one
``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file). ``Weights`` reads the headers only
(names, shapes) when the model is described, so that every way the folder
cannot serve the model -- no config.json, an index naming a missing shard, a
tensor the model needs and no file holds, a shape the config does not give --
is one line before any rank starts. Each rank then opens the shards lazily
(safetensors' ``safe_open``) and reads the tensors of the layers it builds,
and no others; a tied parameter (GPT-2's head and its embedding) is read under
whichever of its names the files hold.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.materialise import Slice

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def folder_of(entry: str) -> Path | None:
    """The folder ``hf:PATH`` names (None: ``hf:TYPE``, a model type built from its config).

    A name with a path separator, or one that exists on disk, is a folder.

    Raises:
        UserError: a path that is no folder, or a folder without config.json.
    """
    name = entry.partition(":")[2]
    path = Path(name).expanduser()
    if not (os.sep in name or name.startswith(".") or path.exists()):
        return None
    if not path.is_dir():
        raise UserError(
            f"--model {entry}: {name} is no folder; give a folder written by save_pretrained, or a model type"
        )
    if not (path / "config.json").is_file():
        raise UserError(
            f"--model {entry}: {path} has no config.json; give a folder written by save_pretrained (config.json "
            "and model.safetensors)"
        )
    return path


class Weights:
    """The safetensors of a pretrained folder: which file holds each tensor, and its shape (headers only).

    Raises:
        UserError: no safetensors in the folder, an index that is not JSON or names a missing shard, a shard
            safetensors cannot open.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        if (folder / INDEX).is_file():
            try:
                weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise UserError(
                    f"{folder / INDEX} is no safetensors index ({exc}); give the index save_pretrained wrote"
                ) from None
            files = sorted(set(weight_map.values()))
        elif (folder / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise UserError(
                f"{folder} has no {SINGLE} or {INDEX}; save the model with save_pretrained (safetensors, the "
                "default) into it"
            )
        self.file_of: dict[str, str] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        for file in files:
            if not (folder / file).is_file():
                raise UserError(f"{folder / INDEX} names the shard {file}, which is missing; copy it into {folder}")
            with _open(folder / file) as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is no mapping
                    self.file_of[name] = file
                    self.shape_of[name] = tuple(shard.get_slice(name).get_shape())

    def check(self, module: nn.Module) -> None:
        """Every parameter and persistent buffer of ``module`` is in the files (by one of its names), in its shape.

        Raises:
            UserError: a tensor missing, or of another shape than the module's.
        """
        for names, tensor in state_groups(module):
            held = [n for n in names if n in self.file_of]
            if not held:
                raise UserError(
                    f"{self.folder} holds no tensor {names[0]} that its config.json's model has; give the folder "
                    "its weights were saved in"
                )
            shape = self.shape_of[held[0]]
            if shape != tuple(tensor.shape):
                raise UserError(
                    f"{self.folder / self.file_of[held[0]]}: {held[0]} has shape {list(shape)}, the model of "
                    f"config.json {list(tensor.shape)}; give the config.json its weights were saved with"
                )

    def reader(self, module: nn.Module) -> Callable[..., dict[str, torch.Tensor]]:
        """``read(names, slices)``: the tensors of ``module`` (the model, on the meta device) of these names, read
        from the files (``models.materialise.materialise`` takes it)."""
        alias = {n: [m for m in names if m in self.file_of][0] for names, _ in state_groups(module) for n in names}
        return functools.partial(self.load, alias=alias)

    def load(
        self, names: list[str], slices: Mapping[str, Slice] | None = None, *, alias: dict[str, str]
    ) -> dict[str, torch.Tensor]:
        """The files' tensors of ``names`` (``alias``: the name a file holds each by), each shard opened once;
        names the files do not hold (buffers computed from the config) are left out. A name in ``slices`` is read
        as that slice alone (``read_slice``: the rest of the tensor is never read)."""
        slices = slices or {}
        wanted: dict[str, list[str]] = {}
        for name in names:
            if name in alias:
                wanted.setdefault(self.file_of[alias[name]], []).append(name)
        values = {}
        for file, held in wanted.items():
            with _open(self.folder / file) as shard:
                for name in held:
                    if name in slices:
                        values[name] = read_slice(shard, alias[name], *slices[name])
                    else:
                        values[name] = shard.get_tensor(alias[name])
        return values


def read_slice(shard: Any, name: str, dim: int, indices: torch.Tensor) -> torch.Tensor:
    """The indices ``indices`` along ``dim`` of the tensor ``name`` of an open safetensors file, reading those
    alone: one ``get_slice`` read per run of consecutive indices (a fused projection's share: one per part)."""
    view = shard.get_slice(name)
    starts = [0, *(k for k in range(1, len(indices)) if indices[k] != indices[k - 1] + 1)]
    ends = [*starts[1:], len(indices)]
    lead = (slice(None),) * dim
    pieces = [view[(*lead, slice(int(indices[a]), int(indices[b - 1]) + 1))] for a, b in zip(starts, ends)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def state_groups(module: nn.Module) -> Iterable[tuple[list[str], torch.Tensor]]:
    """Each parameter or persistent buffer of ``module`` once, with every name it goes by (tied ones: several)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    persistent = set(module.state_dict(keep_vars=True))
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        if name in persistent:
            groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return groups.values()


def _open(path: Path) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{path} is no safetensors file safetensors can open ({exc}); save it again") from None
