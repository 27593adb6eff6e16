"""Peak resident memory of each rank while it builds its parts, and in its first step (README.md beside).

Each rank is a fresh process, run one after another (their peaks do not
depend on each other), doing what a rank of ``pipeweave train`` does before
its first step and in it: describe the model (``ModelSpec.custom``: built
and traced), build the layers of its part (``models.build.build_layers``),
then one forward, backward and SGD update of those layers on one microbatch
(the input of a later part: a random tensor of the shape that part takes,
found by running the model's parts on the meta device). The figures are
the growth of the resident set over the process's own after importing torch
and pipeweave: ``VmHWM`` (the kernel's peak resident set, reset through
``/proc/self/clear_refs``) minus the ``VmRSS`` before.

    python benchmarks/models/build_memory.py --rounds 3            # this tree
    PYTHONPATH=OTHER/src python benchmarks/models/build_memory.py  # another tree (the code before)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LLAMA = {
    "num_hidden_layers": 12,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
"""A Llama-shaped model of 201 million parameters (766 MiB in float32)."""
BUILT_IN = {"kind": "llama", "layers": 12, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn_hidden": 2816,
            "vocab": 32000}
"""pipeweave's own llama of about the same shape (its byte vocabulary widened to 32,000 tokens)."""
SEQ, MICROBATCH = 128, 2


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


def rank_job(model: str, parts: int, rank: int) -> dict[str, Any]:
    """One rank's figures: the model's bytes, its part's, and its peak growth while building and in a step."""
    import torch

    from pipeweave.models.build import build_layers
    from pipeweave.models.spec import loss_fn, uniform_parts
    from pipeweave.runtime.process import keep_freed_host_memory

    torch.set_num_threads(1)
    keep_freed_host_memory()  # as every rank does
    spec = _spec(model)
    base = _status("VmRSS")
    _reset_peak()
    started = time.perf_counter()
    part = uniform_parts(spec.num_layers, parts)[rank]
    layers = build_layers(spec, part)
    built_s = time.perf_counter() - started
    build_peak = _status("VmHWM") - base
    part_bytes = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    _reset_peak()
    x, targets = _inputs(spec, part)
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    for layer in layers:
        x = layer(*x) if isinstance(x, tuple) else layer(x)
    out = loss_fn(spec)(x, targets) if part.stop == spec.num_layers else x.float().square().mean()
    out.backward()
    optimizer.step()
    step_peak = _status("VmHWM") - base
    return {
        "model": model, "parts": parts, "rank": rank, "model_bytes": _model_bytes(spec),
        "part_bytes": part_bytes, "build_peak": build_peak, "step_peak": step_peak, "built_s": built_s,
    }


def _spec(model: str) -> Any:
    from pipeweave.models.spec import ModelSpec

    if model == "llama":
        return ModelSpec(**BUILT_IN, seq_len=SEQ)
    entry = "hf:llama" if model == "hf:llama" else model  # else: hf:FOLDER, a saved model
    return ModelSpec(kind="custom", entry=entry, hf_config=json.dumps(LLAMA) if model == "hf:llama" else None,
                     seq_len=SEQ)


def _model_bytes(spec: Any) -> int:
    """The whole model's parameter bytes, from its shapes alone."""
    import torch

    if spec.kind != "custom":
        from pipeweave.models.build import build_layers

        with torch.device("meta"):
            return sum(p.numel() * 4 for layer in build_layers(spec, range(spec.num_layers)) for p in layer.parameters())
    names: dict[str, int] = {}
    for build in spec.custom.layers:
        for name, p in _part_of(build).named_parameters():
            if not name.startswith("pipeweave_linear"):
                names[name] = p.numel() * 4
    return sum(names.values())


def _part_of(build: Any) -> Any:
    """The part a layer builder holds (``functools.partial`` s around it: the code before held it deeper)."""
    import torch

    while not isinstance(build, torch.nn.Module):
        build = build.args[0]
    return build


def _inputs(spec: Any, part: range) -> tuple[Any, Any]:
    """A microbatch's input of ``part`` (tokens, or a random tensor of the shape the part before gives) and its
    targets."""
    import torch

    tokens = torch.randint(0, 256, (MICROBATCH, SEQ))
    if part.start == 0:
        return tokens, tokens
    if spec.kind != "custom":
        return torch.randn(MICROBATCH, SEQ, spec.hidden, requires_grad=True), tokens
    first = _part_of(spec.custom.layers[0])
    x: Any = tokens.to("meta") if next(first.parameters()).is_meta else tokens
    with torch.no_grad():
        for build in spec.custom.layers[: part.start]:  # the parts on the meta device: shapes, no memory
            layer = _part_of(build)
            x = layer(*x) if isinstance(x, tuple) else layer(x)
    if isinstance(x, tuple):
        return tuple(torch.randn(t.shape, dtype=t.dtype).requires_grad_(t.is_floating_point()) for t in x), tokens
    return torch.randn(x.shape, dtype=x.dtype, requires_grad=True), tokens


def _run_rank(model: str, parts: int, rank: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--rank-job", model, str(parts), str(rank)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _save_folder(folder: Path) -> None:
    """The Llama-shaped model saved as a sharded pretrained folder (its own initial weights)."""
    from pipeweave.models.hf import build_module

    build_module("hf:llama", json.dumps(LLAMA), 0).save_pretrained(folder, max_shard_size="200MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-job", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="llama,hf:llama,pretrained")
    parser.add_argument("--parts", default="1,2,4")
    parser.add_argument("--ranks", help="only these ranks of each D (default: all)")
    parser.add_argument("--folder", help="a pretrained folder this script saved before, to reuse (kept)")
    args = parser.parse_args()
    if args.rank_job:
        model, parts, rank = args.rank_job
        print(json.dumps(rank_job(model, int(parts), int(rank))))
        return
    folder = Path(args.folder or tempfile.mkdtemp(prefix="pipeweave-build-memory-"))
    try:
        models = args.models.split(",")
        if "pretrained" in models and not args.folder:
            _save_folder(folder)
        for model in models:
            name = f"hf:{folder}" if model == "pretrained" else model
            for parts in map(int, args.parts.split(",")):
                for rank in [r for r in range(parts) if not args.ranks or str(r) in args.ranks.split(",")]:
                    rounds = [_run_rank(name, parts, rank) for _ in range(args.rounds)]
                    row = rounds[0] | {"model": model}
                    for key in ("build_peak", "step_peak", "built_s"):
                        row[key] = statistics.median(r[key] for r in rounds)
                        row[key + "_rounds"] = [r[key] for r in rounds]
                    print(json.dumps(row), flush=True)
    finally:
        if not args.folder:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
