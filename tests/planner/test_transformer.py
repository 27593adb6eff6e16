"""The planner's transformer is its architecture: grouped-query attention, SwiGLU, FlashAttention, untied heads and
the presets of published models, their FLOPs, parameters and activations from those fields."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pipeweave.cli import main
from pipeweave.planner.flops import step_flops
from pipeweave.planner.memory import GIB, block_activation_bytes
from pipeweave.planner.transformer import MODELS, Transformer


@pytest.mark.parametrize(
    "name, billions",
    [("gpt3-175b", 175.0), ("bloom-176b", 176.2), ("llama3-8b", 8.0), ("llama3-70b", 70.6), ("llama3-405b", 405.9)],
)
def test_presets_have_their_published_parameter_counts(name: str, billions: float) -> None:
    assert MODELS[name].parameters / 1e9 == pytest.approx(billions, rel=0.01)


def test_presets_keep_their_real_layers_and_vocabularies() -> None:
    assert (MODELS["llama3-405b"].layers, MODELS["llama3-405b"].vocab) == (126, 128256)
    assert (MODELS["bloom-176b"].layers, MODELS["bloom-176b"].vocab) == (70, 250880)
    assert MODELS["gpt3-175b"].vocab == 50257
    assert all(MODELS[f"gpt-{n}"].attention == "math" for n in ("1.7b", "39b", "1t"))  # Table 1 as it ran


def test_model_flops_are_six_per_weight_per_token_plus_attention() -> None:
    # Counted from the GEMMs (grouped QKV, three SwiGLU matrices, the untied head), checked against the parameters.
    m = MODELS["llama3-8b"]
    b, s, h, l = 2, m.seq_len, m.hidden, m.layers
    matrices = l * (m.layer_parameters - 2 * h) + m.vocab * h  # no biases; the norms' weights are not GEMMs
    expected = b * s * (6 * matrices + 12 * l * s * h)
    assert step_flops(m, b, recompute="none") == pytest.approx(expected, rel=1e-12)
    assert step_flops(m, b, recompute="full") == pytest.approx(
        expected + b * s * (2 * (matrices - m.vocab * h) + 4 * l * s * h), rel=1e-12
    )


def closed_form(m: Transformer, tp: int) -> float:
    """docs/guide/plan.md: bytes per block per sample, flash, no dropout: s h (8 + (4 + 4 a_kv/a + 6 f/h) / N)."""
    s, h = m.seq_len, m.hidden
    return s * h * (8 + (4 + 4 * m.kv_heads / m.heads + 6 * m.ffn_hidden / h) / tp)


def test_flash_gqa_swiglu_activations_have_no_s_squared_term() -> None:
    m = MODELS["llama3-8b"]
    for tp in (1, 2, 8):
        held = block_activation_bytes(m, tp=tp, recompute="none")[0]
        assert held == pytest.approx(closed_form(m, tp), rel=1e-3)  # the softmax statistics aside: 4 a s / N
    math_held = block_activation_bytes(replace(m, attention="math"), tp=1, recompute="none")[0]
    assert math_held - block_activation_bytes(m, tp=1, recompute="none")[0] == pytest.approx(
        2 * m.heads * m.seq_len**2, rel=1e-3
    )  # the softmax's output, kept for the backward (no dropout)


def test_plan_of_a_long_sequence_gqa_model_reports_the_closed_form(capsys: pytest.CaptureFixture[str]) -> None:
    # 8k tokens, 8 KV heads, SwiGLU, flash, no recomputation: 1F1B's first rank holds D microbatches of its blocks
    # (l/D, or one fewer where the split the planner chose balances the head: 7, 9, 9, 7).
    fixed = ["--tensor-parallel", "2", "--stages", "4", "--microbatch-size", "1", "-s", "1f1b"]
    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--recompute", "none", *fixed]
    assert main([*argv, "--zero", "0", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["configurations"][0]
    m = MODELS["llama3-8b"]
    first = (best["blocks"] or [m.layers // 4])[0]
    expected = 4 * first * closed_form(m, 2) / GIB
    assert best["fits"] and abs(best["memory"]["activations"] - expected) < 2.0, (best, expected)
    assert main([*argv, "--zero", "0", "--json", "--attention", "math"]) == 2  # stored scores: 2 a s^2 / N more
    assert "fits on no split of 8 GPUs" in capsys.readouterr().err


def test_llama_from_its_flags_is_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn-hidden", "14336"]
    common = ["--gpus", "8", "--global-batch", "8", "--tensor-parallel", "8", "--stages", "1", "--json"]
    assert main(["plan", "--model", "llama", *shape, "--seq-len", "8192", "--vocab", "128256", *common]) == 0
    flags = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "llama3-8b", *common]) == 0
    preset = json.loads(capsys.readouterr().out)
    assert flags["model"]["parameters"] == preset["model"]["parameters"]
    assert flags["configurations"][0]["step_time_s"] == preset["configurations"][0]["step_time_s"]
    assert preset["model"]["kv_heads"] == 8 and preset["model"]["attention"] == "flash"


def test_tensor_parallel_splits_the_kv_heads_too() -> None:
    m = Transformer(layers=2, hidden=512, heads=8, kv_heads=2, mlp="swiglu")
    assert m.splits_tensors(2) and not m.splits_tensors(4)
    assert math.isclose(m.ffn_hidden, 1536)
