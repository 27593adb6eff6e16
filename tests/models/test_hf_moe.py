"""Mixture-of-experts ``hf:`` models (Mixtral's sparse MoE block: a router, top-k experts) split by
``pipeweave.pipeline`` before each decoder block: each block, experts and router with it, on one stage, trained
as transformers' own model trains in a plain loop (issue 36).

Tolerance: float32, the same operations in the same order on every stage (rtol 1e-5).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeweave.config import TrainConfig
from pipeweave.models.hf import build_module
from pipeweave.models.spec import ModelSpec

MODELS = Path(__file__).resolve().parent
sys.path.insert(0, str(MODELS))
from tiny_hf import MIXTRAL, QWEN2_MOE, module_run  # noqa: E402

pytestmark = pytest.mark.slow  # transformers' models on several processes: the slow set (.ci/run)

NOTHING_SPAWNED = "pipeweave.runtime.run.launch._spawn"


def _config(spec: ModelSpec, schedule: str, out: Path, **extra: Any) -> TrainConfig:
    return TrainConfig(
        schedule=schedule,
        num_stages=2,
        num_microbatches=4,
        batch_size=8,
        steps=2,
        quiet=True,
        out=str(out),
        model=spec,
        transport="gloo",
        collect_parameters=True,
        optimizer="sgd",  # AdamW scales a gradient's rounding where the gradient is near 0 (a rarely routed row)
        **extra,
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("kind", "schedule"),
    [
        ("mixtral", "1f1b"),
        pytest.param("mixtral", "zb-h1", marks=pytest.mark.slow),
        pytest.param("qwen2_moe", "zb-h1", marks=pytest.mark.slow),
    ],
)
def test_an_hf_mixture_of_experts_on_two_pipeline_ranks_trains_as_transformers_own_model(
    kind: str, schedule: str, tmp_path: Path
) -> None:
    from pipeweave.commands.train_run import run_config

    fields = MIXTRAL if kind == "mixtral" else QWEN2_MOE
    spec = ModelSpec(kind="custom", entry=f"hf:{kind}", hf_config=json.dumps(fields), seq_len=8, seed=3)
    config = _config(spec, schedule, tmp_path)
    records: list[Any] = []
    assert run_config(config, records.append) == 0
    record = records[0]
    own = build_module(spec.entry or "", spec.hf_config, spec.seed)  # the same initialisation, whole
    losses, own = module_run(own, config)
    torch.testing.assert_close(record.losses, losses, rtol=1e-5, atol=1e-6)
    mine = dict(own.named_parameters(remove_duplicate=False))
    trained = {
        name.partition(".")[2]: value
        for rank in record.ranks
        for params in rank.parameters.values()
        for name, value in params.items()
        if ".pipeweave_linear_" not in name
    }
    assert {n for n in mine if ".experts." in n} <= set(trained)  # every expert trained, on some stage
    for name, value in trained.items():
        torch.testing.assert_close(value, mine[name].detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_its_parts_equal_the_whole_model_whichever_experts_the_router_leaves_without_tokens() -> None:
    from pipeweave.models.build import build_layers

    config = {**MIXTRAL, "num_local_experts": 8, "num_experts_per_tok": 1}  # 8 tokens a sample: experts left out
    spec = ModelSpec(kind="custom", entry="hf:mixtral", hf_config=json.dumps(config), seq_len=8, seed=3)
    layers = build_layers(spec, range(spec.num_layers))
    whole = build_module(spec.entry or "", spec.hf_config, spec.seed)
    chosen: list[frozenset[int]] = []
    whole.model.layers[0].mlp.gate.register_forward_hook(
        lambda m, a, out: chosen.append(frozenset(out[2].flatten().tolist()))
    )
    for start in (0, 2, 100, 500, 1000):
        x = spec.custom.dataset.tokens[start : start + 1]
        for layer in layers:
            x = layer(x)
        logits = x.logits if hasattr(x, "logits") else x
        torch.testing.assert_close(logits, whole(spec.custom.dataset.tokens[start : start + 1]).logits, rtol=0, atol=0)
    assert len(set(chosen)) > 1 and all(len(c) < 8 for c in chosen), chosen  # the inputs route differently


def _cli(config: dict[str, Any], *extra: str) -> list[str]:
    return ["train", "--model", "hf:mixtral", "--hf-config", json.dumps(config), "--seq-len", "8", "--steps", "1",
            "--quiet", "--stages", "2", *extra]  # fmt: skip


def test_what_an_hf_mixture_of_experts_cannot_take_is_one_line(cli_error: Callable[..., str]) -> None:
    err = cli_error(_cli(MIXTRAL, "--data-parallel", "2", "--expert-parallel", "2"), NOTHING_SPAWNED)
    assert "--expert-parallel 2 splits pipeweave's own MoE layers, not the experts of --model hf:mixtral" in err
    assert "drop --expert-parallel, or use --model llama --moe-experts E" in err
    err = cli_error(_cli(MIXTRAL, "--tensor-parallel", "2"), NOTHING_SPAWNED)
    assert "hf:mixtral's tensor-parallel plan splits model.layers.*.mlp.experts.gate_up_proj by 'packed_colwise'" in err
    assert "give --tensor-parallel 1" in err
    err = cli_error(_cli({**MIXTRAL, "output_router_logits": True}), NOTHING_SPAWNED)
    assert "--model hf:mixtral with output_router_logits=true: its router auxiliary loss spans" in err
    assert "drop it from --hf-config" in err
