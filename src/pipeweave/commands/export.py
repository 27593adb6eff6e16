"""``pipeweave export CHECKPOINT DIR``: a checkpoint of an ``hf:`` model (``--save``) as a folder
``from_pretrained`` loads, the same format ``--save-pretrained`` writes (``models.export``).

A checkpoint's keys name layers (``parameters/<layer>.<name in layer>``),
whatever the D, N, P, ZeRO stage or schedule that saved it, and a
tensor-parallel shard or ZeRO slice is saved whole; so the export reads one
layer's parameters at a time (DCP reads only the keys asked for), writes them
as one shard, and joins the shards with an index, the config and, for a model
from a folder, its tokenizer. A tied group is written once, under the name
transformers keeps. Nothing is trained: no process group, no ranks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeweave.errors import UserError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "export",
        help="write a checkpoint of an hf: model as a folder transformers' from_pretrained loads",
        description="Turn a pipeweave checkpoint (--save DIR, or DIR/step-NNNNNN) of an hf: model into sharded "
        "safetensors with model.safetensors.index.json, config.json and the model folder's tokenizer.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a --save folder (its newest checkpoint) or a step-* one")
    p.add_argument("out", metavar="DIR", help="the folder to write (created)")
    return p


def run(args: argparse.Namespace) -> int:
    from pipeweave.commands.outputs import output_folder

    written = export(args.checkpoint, args.out, lambda: output_folder("export DIR", args.out))
    print(f"exported {written} tensors (transformers): {args.out}")
    return 0


def export(checkpoint: str, out: str, check_out: Any = None) -> int:
    """Write the parameters of the checkpoint ``checkpoint`` into ``out``; the number of tensors written.

    Raises:
        UserError: no checkpoint there, a damaged one, one of a model that is no ``hf:`` model, one of the
            first format (part files); as ``models.export.finish``.
    """
    from pipeweave.models.export import finish, saved_names, shard_name, write_shard
    from pipeweave.models.hf import is_hf
    from pipeweave.runtime.run import checkpoint_files
    from pipeweave.runtime.run.checkpoint_storage import read

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
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    folder = found.folder
    names = saved_names(entry, model.get("hf_config"))
    layer_of: dict[str, tuple[int, str]] = {}  # saved name -> (first layer holding it, its checkpoint key)
    for key in FileSystemReader(folder).read_metadata().state_dict_metadata:
        kind, _, name = key.partition("/")
        layer, _, local = name.partition(".")
        if kind == "parameters" and local in names and ".pipeweave_linear_" not in name:
            claim = (int(layer), key)
            layer_of[names[local]] = min(layer_of.get(names[local], claim), claim)
    layers = sorted({layer for layer, _ in layer_of.values()})
    for i, layer in enumerate(layers):
        wanted = {k: key for k, (at, key) in layer_of.items() if at == layer}
        values = read(folder, lambda saved, w=wanted: _empty(saved, w.values()))
        write_shard(Path(out) / shard_name(i, len(layers)), {k: values[key] for k, key in wanted.items()})
    finish(entry, model.get("hf_config"), out, len(layers))
    return len(layer_of)


def _empty(saved: dict[str, Any], keys: Any) -> dict[str, Any]:
    import torch

    return {key: torch.empty(tuple(saved[key][0]), dtype=saved[key][1]) for key in keys}
