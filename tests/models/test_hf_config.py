"""``--hf-config`` values transformers refuses, and keys it would take silently, are one line (``models.hf_config``).

Before: ``n_embd`` not divisible by ``n_head`` was a ValueError traceback (llama's: huggingface_hub's
validation error), ``activation_function: "banana"`` a KeyError, a value of the wrong type a validation
traceback, a zero or negative size a ZeroDivisionError or RuntimeError, a misspelt key (``n_embed``) an
attribute nothing read, and ``--seq-len`` beyond ``n_positions`` was blamed on the layer list ("layer 0 of
the model fails on the dataset's inputs").
"""

from __future__ import annotations

import json
import re

import pytest

from pipeweave.errors import UserError
from pipeweave.models.hf import build_module

pytest.importorskip("transformers")

GPT2 = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 32}
LLAMA = {
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "vocab_size": 256,
}


@pytest.mark.parametrize(
    ("entry", "fields", "message"),
    [
        ("hf:gpt2", {"n_embd": 30, "n_head": 4}, "--hf-config n_embd=30 is not divisible by n_head=4; give n_embd=32"),
        (
            "hf:llama",
            {"hidden_size": 30, "num_attention_heads": 4},
            "--hf-config hidden_size=30 is not divisible by num_attention_heads=4; give hidden_size=32",
        ),
        (
            "hf:gpt2",
            {"activation_function": "banana"},
            "--hf-config activation_function='banana' is no activation transformers knows; choose one of: gelu,",
        ),
        (
            "hf:llama",
            {"hidden_act": "silv"},
            "--hf-config hidden_act='silv' is no activation transformers knows; did you mean 'silu'? choose one of:",
        ),
        (
            "hf:gpt2",
            {"n_head": "two"},
            "--hf-config n_head='two' is refused by transformers (Field 'n_head' expected int, got str",
        ),
        (
            "hf:gpt2",
            {"n_head": 0},
            "--hf-config n_head=0 is refused by transformers (integer division or modulo by zero)",
        ),
        (
            "hf:gpt2",
            {"n_embd": -4},
            "--hf-config n_embd=-4 is refused by transformers (Trying to create tensor with negative dimension -4",
        ),
        ("hf:gpt2", {"n_embed": 64}, "--hf-config key 'n_embed' is not a field of GPT2Config; did you mean 'n_embd'?"),
        (
            "hf:llama",
            {"num_layers": 2},
            "--hf-config key 'num_layers' is not a field of LlamaConfig; did you mean 'num_hidden_layers'?",
        ),
    ],
)
def test_a_config_transformers_refuses_or_does_not_know_is_one_line_naming_the_field_and_the_fix(
    entry: str, fields: dict[str, object], message: str
) -> None:
    base = GPT2 if entry == "hf:gpt2" else LLAMA
    with pytest.raises(UserError, match="^" + re.escape(message)) as caught:
        build_module(entry, json.dumps({**base, **fields}), seed=0)
    assert "\n" not in str(caught.value)


def test_seq_len_beyond_the_positions_names_the_positions_field_not_the_layer_list() -> None:
    with pytest.raises(UserError) as caught:
        build_module("hf:gpt2", json.dumps({**GPT2, "n_positions": 8}), seed=0, seq_len=16)
    assert str(caught.value) == (
        "--seq-len 16 is longer than hf:gpt2's n_positions=8 (--hf-config); give --seq-len 8 or less, or "
        "n_positions >= 16 in --hf-config"
    )
    build_module("hf:gpt2", json.dumps({**GPT2, "n_positions": 16}), seed=0, seq_len=16)  # as long as it embeds


def test_the_fields_aliases_and_a_head_width_of_its_own_are_taken() -> None:
    aliased = build_module("hf:gpt2", json.dumps({**GPT2, "hidden_size": 64}), seed=0)  # gpt2's alias of n_embd
    assert aliased.config.n_embd == 64
    import transformers

    from pipeweave.models.hf_config import make_config

    qwen3 = make_config(transformers, "hf:qwen3", {"hidden_size": 30, "num_attention_heads": 4})  # head_dim 128
    assert qwen3.head_dim == 128
