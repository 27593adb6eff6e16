"""``--save-pretrained DIR``: a trained ``hf:`` model written as a folder ``from_pretrained`` loads, in pieces.

Each rank writes the tensors of its own parts into one shard
(``shard_name``: ``model-RRRRR-of-NNNNN.safetensors``, R its stage rank); no
rank holds more than its parts. A tied group (GPT-2's head and embedding,
each on its own stage) is written once, under the name transformers keeps
(``saved_names``: not the one its ``_tied_weights_keys`` drops), by the first
layer holding it. Once every shard is written, ``finish`` reads their
headers and writes ``model.safetensors.index.json`` (``weight_map``: tensor
-> shard), ``config.json``, and, for a model from a folder (``hf:PATH``),
that folder's tokenizer; shards left empty, and weight files of an earlier
save into DIR, are removed, so ``from_pretrained`` reads this save alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pipeweave.durable import reason, replacing, write_atomic
from pipeweave.errors import OutputNotWritten
from pipeweave.models.hf import import_transformers, meta_module, trained_config
from pipeweave.models.pretrained import INDEX, SINGLE, folder_of, state_groups

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
"""The files of a Hugging Face tokenizer copied beside the weights (those the model's folder holds)."""


def saved_names(entry: str, config_text: str | None) -> dict[str, str]:
    """Every parameter name of the model of ``hf:NAME`` -> the name it is saved under (a tied group's: the
    one transformers keeps, the others it ties back when loading)."""
    module = meta_module(entry, config_text)
    tied = getattr(module, "_tied_weights_keys", None) or ()
    dropped = set(tied)  # a mapping (its keys: the names tied to another) or a list of them
    out: dict[str, str] = {}
    for names, tensor in state_groups(module):
        if isinstance(tensor, torch.nn.Parameter):
            kept = next((n for n in names if n not in dropped), names[0])
            out.update(dict.fromkeys(names, kept))
    return out


def shard_name(rank: int, ranks: int) -> str:
    """The shard stage rank ``rank`` of ``ranks`` writes (transformers' naming of shards)."""
    return f"model-{rank + 1:05d}-of-{ranks:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as one safetensors file, whole or not at all (raises OSError)."""
    from safetensors.torch import save_file

    with replacing(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})


def finish(entry: str, config_text: str | None, folder: str, ranks: int) -> None:
    """Join the ``ranks`` shards the ranks wrote into ``folder`` with an index, the config and the tokenizer.

    Raises:
        OutputNotWritten: a shard missing (its rank could not write it), a tensor of the model in none, or a
            file that cannot be written.
    """
    from safetensors import safe_open

    path = Path(folder)
    weight_map: dict[str, str] = {}
    total = 0
    written = [shard_name(r, ranks) for r in range(ranks)]
    for name in written:
        if not (path / name).is_file():
            raise OutputNotWritten(f"--save-pretrained {folder}: {name} was not written; save again")
        with safe_open(str(path / name), framework="pt") as shard:
            for key in shard.keys():  # noqa: SIM118 - safe_open is no mapping
                weight_map[key] = name
                piece = shard.get_slice(key)
                total += _numel(piece.get_shape()) * _itemsize(piece.get_dtype())
    lacking = sorted(set(saved_names(entry, config_text).values()) - set(weight_map))
    if lacking:
        raise OutputNotWritten(f"--save-pretrained {folder}: no shard holds {lacking[0]}; save again")
    kept = set(weight_map.values())
    try:
        for name in written:
            if name not in kept:
                (path / name).unlink()  # a rank whose tensors another wrote: no empty shard in the index
        for stale in [path / SINGLE, *path.glob("model-*-of-*.safetensors")]:
            if stale.is_file() and stale.name not in kept:  # an earlier save's: from_pretrained would read it
                stale.unlink()
        _write_config(entry, config_text, path)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_atomic(path / INDEX, json.dumps(index, indent=2) + "\n")
    except OSError as exc:
        raise OutputNotWritten(f"--save-pretrained {folder}: {reason(exc)}; give a writable folder") from None


def _write_config(entry: str, config_text: str | None, path: Path) -> None:
    """config.json (a folder's own, copied), and the tokenizer files of the folder ``hf:PATH``."""
    source = folder_of(entry)
    if source is None:
        config = trained_config(import_transformers(entry), entry, config_text)
        config.use_cache = True  # off only while training
        write_atomic(path / "config.json", config.to_json_string())
        return
    if source.resolve() == path.resolve():
        return
    for name in ("config.json", *TOKENIZER_FILES):
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (``F32``, ``BF16``, ``I64``, ``F8_E4M3``, ``BOOL``)."""
    digits = "".join(c for c in dtype.split("_")[0] if c.isdigit())
    return max(1, int(digits) // 8) if digits else 1
