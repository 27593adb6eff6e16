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
from typing import Any


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
    from pipeweave.commands.export_run import export
    from pipeweave.commands.outputs import output_folder

    written = export(args.checkpoint, args.out, lambda: output_folder("export DIR", args.out))
    print(f"exported {written} tensors (transformers): {args.out}")
    return 0
