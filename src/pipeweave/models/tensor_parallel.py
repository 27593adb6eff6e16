"""What a model says about its tensor-parallel split: a plan per layer, and the sizes it needs to divide.

A **plan** maps a layer's linear submodules, by name, to a style (Megatron-LM's
split, Shoeybi et al. 2019; the runtime's ``stage.tensor_parallel`` applies it):

- ``colwise``: output features split (the weight's rows); the input comes whole;
- ``colwise_qkv``: a fused Q, K, V projection split by heads, each rank
  keeping its heads' rows of each of the three;
- ``colwise_fused``: a ``models.layers.FusedLinear`` (several projections
  side by side, of the widths its ``parts`` give: grouped-query attention's
  Q, K, V; SwiGLU's gate and up) split part by part, each rank keeping its
  share of each, in order;
- ``colwise_gather``: ``colwise``, the outputs gathered whole after it (a
  vocabulary head before its loss);
- ``rowwise``: input features split (the weight's columns), the partial
  outputs summed, then the bias.

The built-in models give theirs (``gpt.tensor_parallel_plan``,
``llama.tensor_parallel_plan``, ``mlp.tensor_parallel_plan``); a custom ``LayerModel`` its ``tp_plan``;
``pipeweave.pipeline(..., tp_plan=...)`` module-name patterns, resolved per layer (``models.tp_patterns``),
and an ``hf:`` model transformers' own plan (``models.hf_tp``). The layer's own code must work on its rank's
share of the features: the gpt's attention reads the number of heads it holds from its projection's width;
a traced part's literal sizes are rewritten for its shard (``models.graph_shard``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeweave.errors import UserError

STYLES = ("colwise", "colwise_qkv", "colwise_fused", "colwise_gather", "rowwise")


def check_divisible(what: Sequence[tuple[str, int]], size: int) -> None:
    """One line naming the first dimension that ``size`` ranks cannot split evenly."""
    for name, value in what:
        if value % size:
            raise UserError(
                f"{name} {value} is not divisible by --tensor-parallel {size}; give a tensor-parallel "
                f"degree that divides it"
            )
