"""Tensor parallelism for the models users bring (issue 32): ``hf:`` models split by transformers' own plan (or
GPT-2's), ``pipeweave.pipeline(..., tp_plan=...)`` modules by theirs, trained as plain training trains them.

Tolerance: float32 summation order (a row-parallel layer sums its partial products over the group), rtol 1e-5.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pipeweave.commands.train_run import run_config
from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models.hf_tp import hf_tp_plan
from pipeweave.models.spec import ModelSpec
from pipeweave.models.tp_patterns import layer_plans

MODELS = Path(__file__).resolve().parent
sys.path.insert(0, str(MODELS))
from tiny_hf import GPT2, LLAMA, saved_model, transformers_run  # noqa: E402

pytestmark = pytest.mark.slow  # transformers' models on several processes: the slow set (.ci/run)

MODULE = MODELS / "tiny_tp_module.py"
NOTHING_SPAWNED = "pipeweave.runtime.run.launch._spawn"
OPT = {  # a model type whose config declares no tensor-parallel plan
    "num_hidden_layers": 2,
    "hidden_size": 16,
    "num_attention_heads": 2,
    "ffn_dim": 32,
    "word_embed_proj_dim": 16,
    "vocab_size": 300,
    "max_position_embeddings": 32,
}


def _config(spec: ModelSpec, schedule: str, stages: int, out: Path, batch_size: int = 4, **extra: Any) -> TrainConfig:
    return TrainConfig(
        schedule=schedule,
        num_stages=stages,
        num_microbatches=4,
        batch_size=batch_size,
        steps=2,
        quiet=True,
        out=str(out / "record"),
        model=spec,
        transport="gloo",
        tensor_parallel=2,
        collect_parameters=True,
        optimizer="sgd",  # AdamW would scale the rounding of a gradient that is exactly 0 (a key bias's) to lr
        **extra,
    )


def _trained(config: TrainConfig) -> Any:
    records: list[Any] = []
    assert run_config(config, records.append) == 0
    return records[0]


def _parameters(record: Any) -> dict[str, torch.Tensor]:
    """The run's final parameters, whole, by their names in the module (``"<layer>.<name>"`` without the layer)."""
    return {
        name.partition(".")[2]: value
        for rank in record.ranks
        for params in rank.parameters.values()
        for name, value in params.items()
        if ".pipeweave_linear_" not in name
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("kind", "schedule", "stages"),
    [
        ("llama", "zb-h1", 1),
        ("gpt2", "zb-h1", 1),
        pytest.param("llama", "zb-h1", 2, marks=pytest.mark.slow),
        pytest.param("gpt2", "1f1b", 2, marks=pytest.mark.slow),
        pytest.param("llama", "interleaved-1f1b", 2, marks=pytest.mark.slow),
    ],
)
def test_pretrained_hf_models_split_over_two_ranks_train_as_transformers_own_model(
    kind: str, schedule: str, stages: int, tmp_path: Path
) -> None:
    folder = saved_model(tmp_path / "source", kind)
    out = tmp_path / "saved"
    spec = ModelSpec(kind="custom", entry=f"hf:{folder}", seq_len=8)
    chunks = {"num_chunks": 2} if schedule == "interleaved-1f1b" else {}
    record = _trained(_config(spec, schedule, stages, tmp_path, save_pretrained=str(out), **chunks))
    losses, own = transformers_run(folder, _config(spec, schedule, stages, tmp_path, **chunks))
    torch.testing.assert_close(record.losses, losses, rtol=1e-5, atol=1e-6)  # the first: transformers' forward
    trained = _parameters(record)
    mine = dict(own.named_parameters(remove_duplicate=False))
    assert set(trained) <= set(mine)
    for name, value in trained.items():
        torch.testing.assert_close(value, mine[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))  # shards joined per tensor
    for name, value in loaded.named_parameters(remove_duplicate=False):
        if name in trained:
            torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "schedule"), [("attending", "zb-h1"), ("sequential_plan", "1f1b")])
def test_a_module_split_by_its_own_tp_plan_trains_as_plain_training(name: str, schedule: str, tmp_path: Path) -> None:
    from pipeweave.runtime.plain import run_plain
    from pipeweave.runtime.run.prepare import optimizer_factory

    spec = ModelSpec(kind="custom", entry=f"{MODULE}:{name}")
    config = _config(spec, schedule, 2, tmp_path, batch_size=8)
    record = _trained(config)
    plain = run_plain(spec, steps=2, batch_size=8, num_microbatches=4, optimizer_factory=optimizer_factory(config))
    torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
    seen = set()
    for rank in record.ranks:
        for params in rank.parameters.values():
            for name, value in params.items():
                torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6, msg=name)
                seen.add(name)
    assert seen == set(plain.parameters)


def test_transformers_plan_names_each_layers_linear_products() -> None:
    spec = ModelSpec(kind="custom", entry="hf:llama", hf_config=json.dumps(LLAMA), seq_len=8)
    plans = spec.custom.tp_plan
    assert plans[0] is None  # the embedding: whole
    block = spec.custom.layers[1]()
    named = {n: p for n, p in block.named_parameters(remove_duplicate=False)}
    styles = {
        next(n for n, p in named.items() if p is block.get_submodule(local).weight and "pipeweave" not in n): style
        for local, style in plans[1].items()
    }
    assert styles == {
        **{f"model.layers.0.self_attn.{m}_proj.weight": "colwise" for m in "qkv"},
        "model.layers.0.self_attn.o_proj.weight": "rowwise",
        "model.layers.0.mlp.gate_proj.weight": "colwise",
        "model.layers.0.mlp.up_proj.weight": "colwise",
        "model.layers.0.mlp.down_proj.weight": "rowwise",
    }
    assert "colwise_gather" in plans[-1].values()  # the head, untied: its vocabulary split, gathered


def test_gpt2_splits_its_conv1d_layers_and_keeps_its_tied_head_whole() -> None:
    spec = ModelSpec(kind="custom", entry="hf:gpt2", hf_config=json.dumps(GPT2), seq_len=8)
    module = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("gpt2", **GPT2))
    assert "lm_head" not in (hf_tp_plan(module) or {})
    assert sorted(spec.custom.tp_plan[-1].values()) == ["colwise", "colwise_qkv", "rowwise", "rowwise"]


def test_a_plan_entry_that_names_no_linear_layer_or_a_tied_one_is_one_line() -> None:
    sys.path.insert(0, str(MODELS))
    from tiny_modules import Looped, _tokens, token_loss

    import pipeweave

    module = Looped()
    parts = [build.args[0] for build in pipeweave.pipeline(module, loss=token_loss, dataset=_tokens(8, 0)).layers]

    def split(plan: dict[str, Any]) -> Any:
        return layer_plans(module, parts, plan)

    with pytest.raises(UserError, match=r"tp_plan\['blocks.\*.norm'\] matches blocks.0.norm, which is no linear"):
        split({"blocks.*.norm": "colwise"})
    with pytest.raises(
        UserError,
        match=r"tp_plan\['head'\] names head, whose weight is tied \(one Parameter: layer 0's head.weight and layer 3's head.weight\)",
    ):
        split({"head": "colwise_gather"})
    with pytest.raises(UserError, match=r"tp_plan\['blocks.\*.mlp.0'\] = 'sideways' is no style"):
        split({"blocks.*.mlp.0": "sideways"})
    with pytest.raises(UserError, match=r"tp_plan\['nothing'\] matches no module"):
        split({"nothing": "colwise"})
    assert split({"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"})[1] == {
        "pipeweave_linear_2": "colwise",
        "pipeweave_linear_3": "rowwise",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "hf:llama", "--hf-config", json.dumps({**LLAMA, "num_key_value_heads": 1})],
            "num_key_value_heads 1 is not divisible by --tensor-parallel 2; give a tensor-parallel degree",
        ),
        (
            ["--model", "hf:gpt2", "--hf-config", json.dumps({**GPT2, "n_head": 1})],
            "num_attention_heads 1 is not divisible by --tensor-parallel 2",
        ),
        (
            ["--model", "hf:llama", "--hf-config", json.dumps({**LLAMA, "intermediate_size": 25})],
            "intermediate_size 25 is not divisible by --tensor-parallel 2",
        ),
        (
            ["--model", "hf:opt", "--hf-config", json.dumps(OPT)],
            "hf:opt declares no tensor-parallel plan pipeweave applies (transformers' base_model_tp_plan, styles "
            "colwise/rowwise); split it with pipeweave.pipeline(module, ..., tp_plan=",
        ),
        (
            ["--model", f"{MODELS / 'tiny_modules.py'}:plain_factory"],
            "has no tp_plan; give its LayerModel a tp_plan (per layer, {module name: 'colwise' or 'rowwise'}), "
            "or pipeweave.pipeline(..., tp_plan=",
        ),
        (
            ["--model", "hf:llama", "--hf-config", json.dumps(LLAMA), "--sequence-parallel"],
            "--model hf:llama computes positions and masks from the sequence it is given, which a shard would "
            "shorten: drop --sequence-parallel",
        ),
    ],
    ids=["kv-heads", "gpt2-heads", "intermediate", "no-plan", "module-no-plan", "sequence-parallel"],
)
def test_bad_tensor_parallel_input_is_one_line_before_spawning(
    argv: list[str], message: str, cli_error: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    base = ["train", "--tensor-parallel", "2", "--batch", "4", "--steps", "1", "--quiet"]
    hf = ["--seq-len", "8"] if argv[1].startswith("hf:") else []
    err = cli_error([*base, *hf, *argv], NOTHING_SPAWNED)
    assert message in err, err


def test_a_colwise_layer_without_its_rowwise_partner_is_one_line(tmp_path: Path) -> None:
    from tiny_tp_module import Attending, _tokens, token_loss

    import pipeweave
    from pipeweave.runtime.stage.tensor_parallel import check_plans

    model = pipeweave.pipeline(Attending(), loss=token_loss, dataset=_tokens(8, 0), tp_plan={"blocks.*.up": "colwise"})
    spec = ModelSpec(kind="custom", entry=pipeweave.models.custom.hold(model, "tp-partner"))
    with pytest.raises(UserError, match=r"blocks.0.down takes 32 features on a tensor-parallel shard and is given 16"):
        check_plans(spec, 2)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_traced_parts_head_count_is_its_shards(device: str) -> None:
    from tiny_tp_module import HEADS, Attending, _tokens, tp_plan

    import pipeweave
    from pipeweave.runtime.stage.tensor_parallel import split
    from pipeweave.runtime.transport.mesh import MEASURING, TensorParallel

    model = pipeweave.pipeline(Attending(), loss=lambda y, t: y.sum(), dataset=_tokens(8, 0), tp_plan=tp_plan)
    block = model.layers[1]().to(device)
    views = [n for n in block.graph.nodes if n.target == torch.ops.aten.view.default and len(n.args[1]) == 4]
    assert [n.args[1][2] for n in views] == [HEADS] * 3  # Q, K, V: the head count, a literal in the graph
    block = split(block, model.tp_plan[1], TensorParallel(MEASURING, 1, 2), "layer 1")
    assert [n.args[1][2] for n in views] == [HEADS // 2] * 3
    x = torch.randn(3, 5, 16, device=device)
    assert block(x).shape == (3, 5, 16)  # (no all-reduce here: the shapes alone)
