"""The tensor-parallel plan of an ``hf:`` model: transformers' own, where the model declares one, or GPT-2's.

transformers declares a plan on the configs of Llama, Mistral, Qwen2 and
their like (``base_model_tp_plan``, merged with the head's on the model as
``model.tp_plan``): ``colwise`` for the attention's Q, K, V and the MLP's gate
and up projections, ``rowwise`` for their outputs, the head
``colwise_gather_output``. Those styles are pipeweave's (``colwise``,
``rowwise``, ``colwise_gather``); the ones that keep a module whole on every
rank (the embedding's and the norms', which pipeweave replicates) are left out,
and so is a head tied to the embedding (splitting it would untie them). A plan
with any other style (packed or expert-parallel layers) is not taken: the
model then has no plan, and ``--tensor-parallel`` says so.

GPT-2 declares none; its ``Conv1D`` layers are split here: ``c_attn`` (Q, K
and V side by side) by heads of each (``colwise_qkv``), the attention's
``c_proj`` row-wise, the MLP's ``c_fc`` column-wise and ``c_proj`` row-wise.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.tensor_parallel import check_divisible
from pipeweave.models.tp_patterns import matches

GPT2_PLAN = {
    "transformer.h.*.attn.c_attn": "colwise_qkv",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}
_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "colwise_rep": "colwise_gather",
    "colwise_gather_output": "colwise_gather",
}
_WHOLE = {"embedding_rowwise", "sequence_parallel", "replicated_with_grad_allreduce", "isolated", "local"}
"""Styles of modules pipeweave keeps whole on every rank (their inputs and outputs are whole there)."""


def hf_tp_plan(module: nn.Module) -> dict[str, str] | None:
    """``module``'s plan in pipeweave's styles (``models.tp_patterns``), or None: none declared, or a style
    pipeweave does not apply."""
    declared = dict(getattr(module, "tp_plan", None) or getattr(module, "_tp_plan", None) or {})
    if not declared:
        return dict(GPT2_PLAN) if getattr(module.config, "model_type", None) == "gpt2" else None
    names = [n for n, _ in module.named_modules() if n]
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    embedding = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    plan = {}
    for pattern, style in declared.items():
        hit = [n for n in names if matches(pattern, n)]
        if not hit or style in _WHOLE or tied and any(module.get_submodule(n) is head for n in hit):
            continue
        if style not in _STYLES:
            return None
        plan[pattern] = _STYLES[style]
    return plan


def check_sizes(config: Any, size: int) -> None:
    """One line naming the first of the config's heads, key/value heads and MLP width ``size`` does not divide."""
    sizes = [
        (name, getattr(config, name, None))
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    ]
    if getattr(config, "model_type", None) == "gpt2":  # its MLP: n_inner, 4 x n_embd where unset
        sizes.append(("n_inner", getattr(config, "n_inner", None) or 4 * config.n_embd))
    check_divisible([(name, value) for name, value in sizes if isinstance(value, int)], size)


def untaken_style(module: nn.Module) -> tuple[str, str] | None:
    """The first (pattern, style) of ``module``'s declared plan that pipeweave does not apply (a mixture of
    experts' ``packed_colwise``, ``moe_tp_experts``), or None."""
    declared = dict(getattr(module, "tp_plan", None) or getattr(module, "_tp_plan", None) or {})
    return next(((p, s) for p, s in declared.items() if s not in _STYLES and s not in _WHOLE), None)


def no_plan(entry: str, size: int, untaken: tuple[str, str] | None = None) -> UserError:
    """The line for an ``hf:`` model without a plan pipeweave applies (``untaken``: the style it declares that
    pipeweave does not apply)."""
    if untaken is not None:
        return UserError(
            f"--tensor-parallel {size}: {entry}'s tensor-parallel plan splits {untaken[0]} by '{untaken[1]}', a "
            "style pipeweave does not apply (a mixture of experts' layers are kept whole); give --tensor-parallel 1"
        )
    return UserError(
        f"--tensor-parallel {size}: {entry} declares no tensor-parallel plan pipeweave applies (transformers' "
        "base_model_tp_plan, styles colwise/rowwise); split it with pipeweave.pipeline(module, ..., "
        "tp_plan={'layers.*.q_proj': 'colwise', ...}) in a model file, or give --tensor-parallel 1"
    )
