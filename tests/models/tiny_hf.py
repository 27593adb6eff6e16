"""Tiny GPT-2 and Llama-shaped ``transformers`` models saved into a folder (``save_pretrained``): what users
load with ``--model hf:PATH``, made in the test (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

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


def saved_model(folder: Path, kind: str, seed: int = 11, shard: str | None = None) -> Path:
    config = transformers.AutoConfig.for_model(kind, **(GPT2 if kind == "gpt2" else LLAMA))
    torch.manual_seed(seed)  # weights no seed of pipeweave's would give: loaded, not initialised
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, **({} if shard is None else {"max_shard_size": shard}))
    return folder
