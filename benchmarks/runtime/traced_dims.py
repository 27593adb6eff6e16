"""What a dynamic sequence dimension costs a fixed-length run: GPT-2 split by pipeweave.pipeline, traced two ways.

``pipeweave.pipeline`` traces dimension 1 of every input as dynamic where the
module lets it be (``torch.export.Dim.AUTO``), so ``--min-seq-len`` works on
traced and Hugging Face models; before, only the batch was dynamic. This
compares the two traces on fixed-length microbatches: the same
``transformers`` GPT-2 as ``hf_split.py`` (4 blocks, width 128, 4 heads,
256 tokens, 64 positions), split before ``transformer.h.2``, its two parts'
forward and backward chained in one process on one thread, 4 microbatches
of 4 samples x 64 tokens a round. Rounds alternate the traces; each round's
figure is CPU time (``time.process_time``) per microbatch, the ratio
dynamic over static per round. Usage:
``python benchmarks/runtime/traced_dims.py [--rounds 7] [--microbatches 40] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import pipeweave.models.tracing as tracing
from pipeweave.models.boundary import call
from pipeweave.models.hf import ByteWindows, build_module
from pipeweave.models.pipeline import pipeline

CONFIG = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 256, "n_positions": 64, "resid_pdrop": 0.0,
          "embd_pdrop": 0.0, "attn_pdrop": 0.0}
SEQ, SAMPLES, SPLIT = 64, 4, "transformer.h.2"


def _static_export(module: torch.nn.Module, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
    """The trace before: only the batch dimension dynamic."""
    dims = tuple({0: torch.export.Dim.AUTO} for _ in example_inputs)
    return torch.export.export(module, example_inputs, dynamic_shapes=dims, strict=False).module()


def parts(dynamic: bool) -> list[torch.nn.Module]:
    module = build_module("hf:gpt2", json.dumps(CONFIG), 0)
    data = ByteWindows(SEQ)
    original = tracing.export
    if not dynamic:
        tracing.export = _static_export
    try:
        model = pipeline(module, (data.tokens[:SAMPLES],), [SPLIT], loss=lambda out, y: out, dataset=data)
    finally:
        tracing.export = original
    return [build() for build in model.layers]


def round_cost(chain: list[torch.nn.Module], tokens: list[torch.Tensor]) -> float:
    """CPU seconds per microbatch: forward through the parts, backward from the logits' sum."""
    start = time.process_time()
    for x in tokens:
        for part in chain:
            x = call(part, x)
        logits = x.logits if hasattr(x, "logits") else x
        logits.float().sum().backward()
    return (time.process_time() - start) / len(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--microbatches", type=int, default=40)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    chains = {"static": parts(False), "dynamic": parts(True)}
    data = ByteWindows(SEQ)
    tokens = [data.tokens[k * SAMPLES:(k + 1) * SAMPLES] for k in range(args.microbatches)]
    for chain in chains.values():
        round_cost(chain, tokens[:4])  # warm-up
    rows = []
    for r in range(args.rounds):
        order = ["static", "dynamic"] if r % 2 == 0 else ["dynamic", "static"]
        row = {name: round_cost(chains[name], tokens) for name in order}
        row["ratio"] = row["dynamic"] / row["static"]
        rows.append(row)
        print(f"round {r}: static {row['static'] * 1e3:.2f} ms  dynamic {row['dynamic'] * 1e3:.2f} ms  "
              f"ratio {row['ratio']:.3f}")
    median = statistics.median(row["ratio"] for row in rows)
    print(f"median ratio {median:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rows, "median_ratio": median, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
