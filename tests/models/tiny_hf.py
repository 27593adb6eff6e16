"""Tiny GPT-2 and Llama-shaped ``transformers`` models saved into a folder (``save_pretrained``): what users
load with ``--model hf:PATH``, made in the test (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

GPT2 = {
    "n_layer": 3,
    "n_embd": 16,
    "n_head": 2,
    "vocab_size": 300,
    "n_positions": 32,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
LLAMA = {
    "num_hidden_layers": 3,
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "vocab_size": 300,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
MIXTRAL = {  # Mixtral's sparse MoE block: 4 experts, each token to 2
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "vocab_size": 300,
    "max_position_embeddings": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
QWEN2_MOE = {  # Qwen2-MoE's: 4 routed experts (top-2, gates not renormalised) beside a gated shared expert
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 48,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 300,
    "max_position_embeddings": 32,
}


def saved_model(folder: Path, kind: str, seed: int = 11, shard: str | None = None) -> Path:
    config = transformers.AutoConfig.for_model(kind, **(GPT2 if kind == "gpt2" else LLAMA))
    torch.manual_seed(seed)  # weights no seed of pipeweave's would give: loaded, not initialised
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, **({} if shard is None else {"max_shard_size": shard}))
    return folder


def transformers_run(folder: Path, config: Any) -> tuple[list[float], Any]:
    """transformers' own model of ``folder`` trained by a plain loop on ``config``'s batches, microbatches,
    optimizer and steps: its per-step losses and the trained model."""
    return module_run(transformers.AutoModelForCausalLM.from_pretrained(str(folder)), config)


def module_run(own: Any, config: Any) -> tuple[list[float], Any]:
    """transformers' model ``own`` trained by a plain loop on ``config``'s batches, microbatches, optimizer and
    steps, with its own forward and loss: its per-step losses and the trained model."""
    from pipeweave.data import data_source, split_microbatches
    from pipeweave.runtime.run.prepare import optimizer_factory

    own.train()
    optimizer = optimizer_factory(config)(list(own.parameters()))
    source = data_source(config.model, batch_size=config.batch_size, seed=config.data.data_seed)
    losses = []
    for step in range(config.steps):
        inputs, _ = source.batch(step)
        total = torch.zeros(())
        for x in split_microbatches(inputs, config.num_microbatches):
            loss = own(input_ids=x, labels=x).loss * (len(x) / len(inputs))
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
    return losses, own
