"""``pipeweave export``, once parsed (``commands.export``): read a checkpoint layer by layer, write the folder.

Imported only when ``pipeweave export`` runs, so that ``pipeweave --help`` and the other subcommands start
without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeweave.durable import reason
from pipeweave.errors import OutputNotWritten, UserError
from pipeweave.models.export import finish, saved_names, shard_name, write_shard
from pipeweave.models.hf import is_hf
from pipeweave.runtime.run import checkpoint_files
from pipeweave.runtime.run.checkpoint_storage import read


def export(checkpoint: str, out: str, check_out: Any = None) -> int:
    """Write the parameters of the checkpoint ``checkpoint`` into ``out``; the number of tensors written.

    Raises:
        UserError: no checkpoint there, a damaged one, one of a model that is no ``hf:`` model, one of the
            first format (part files); as ``models.export.finish``.
    """
    found = checkpoint_files.find(checkpoint)
    checkpoint_files.verify(found, checkpoint)
    model = found.manifest.get("model", {})
    entry = model.get("entry")
    if not is_hf(entry):
        raise UserError(
            f"export {checkpoint}: its checkpoint is of --model {entry or model.get('kind')}, not an hf: model; "
            "export writes transformers folders of hf: models only"
        )
    if found.legacy or found.manifest.get("format") != checkpoint_files.FORMAT:
        raise UserError(f"export {checkpoint}: a checkpoint of the first format; resume it and --save it again")
    if check_out is not None:
        check_out()
    folder = found.folder
    names = saved_names(entry, model.get("hf_config"))
    layer_of: dict[str, tuple[int, str]] = {}  # saved name -> (first layer holding it, its checkpoint key)

    def parameters(saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        for key in saved:
            kind, _, name = key.partition("/")
            layer, _, local = name.partition(".")
            if kind == "parameters" and local in names and ".pipeweave_linear_" not in name:
                claim = (int(layer), key)
                layer_of[names[local]] = min(layer_of.get(names[local], claim), claim)
        return {}  # the keys alone: nothing read

    read(folder, parameters)
    layers = sorted({layer for layer, _ in layer_of.values()})
    for i, layer in enumerate(layers):
        wanted = {k: key for k, (at, key) in layer_of.items() if at == layer}
        values = read(folder, lambda saved, w=wanted: _empty(saved, w.values()))
        path = Path(out) / shard_name(i, len(layers))
        try:
            write_shard(path, {k: values[key] for k, key in wanted.items()})
        except OSError as exc:
            raise OutputNotWritten(
                f"export {out}: cannot write {path.name} ({reason(exc)}); give a writable DIR"
            ) from None
    finish(entry, model.get("hf_config"), out, len(layers))
    return len(layer_of)


def _empty(saved: dict[str, Any], keys: Any) -> dict[str, Any]:
    return {key: torch.empty(tuple(saved[key][0]), dtype=saved[key][1]) for key in keys}
