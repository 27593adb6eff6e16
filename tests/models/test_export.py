"""``--save-pretrained DIR``: each rank writes its own parts' tensors as one shard, joined by an index that
``from_pretrained`` loads into the run's trained weights exactly (issue 32). Models are made in the test."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pipeweave.cli import main
from pipeweave.commands.train_run import run_config
from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models.spec import ModelSpec

MODELS = Path(__file__).resolve().parent
sys.path.insert(0, str(MODELS))
from tiny_hf import saved_model  # noqa: E402

GPT2_FIELDS = {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 300, "n_positions": 16}


def _saved(folder: Path, kind: str) -> Path:
    saved_model(folder, kind, seed=5)
    (folder / "special_tokens_map.json").write_text('{"eos_token": "<eos>"}')  # a tokenizer file to carry along
    return folder


def _trained(folder: Path, out: Path, **options: Any) -> Any:
    """Train ``hf:folder`` 2 steps with ``--save-pretrained out``; the run's record (its final parameters)."""
    records: list[Any] = []
    config = TrainConfig(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        batch_size=4,
        steps=2,
        quiet=True,
        out=str(out.parent / "record"),
        model=ModelSpec(kind="custom", entry=f"hf:{folder}", seq_len=8),
        transport="gloo",
        save_pretrained=str(out),
        save=str(out.parent / "checkpoints"),
        collect_parameters=True,
        **options,
    )
    assert run_config(config, records.append) == 0
    return records[0]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("kind", "options"),
    [
        pytest.param("gpt2", {}, marks=pytest.mark.slow),
        pytest.param("llama", {"data_parallel": 2, "zero": 1}, marks=pytest.mark.slow),
    ],
)
def test_from_pretrained_gives_back_the_trained_weights_each_rank_writing_its_parts(
    kind: str,
    options: dict[str, Any],
    tmp_path: Path,
    cli_error: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = _saved(tmp_path / "source", kind)
    out = tmp_path / "saved"
    out.mkdir()
    torch.save({}, out / "model.safetensors")  # an earlier save's file: from_pretrained must not read it
    record = _trained(source, out, **options)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] or (
        options and len(shards) == 2
    ), shards
    assert not (out / "model.safetensors").exists()
    trained = {}
    for rank in record.ranks:
        for params in rank.parameters.values():
            for name, value in params.items():
                trained.setdefault(name.partition(".")[2], value)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    compared = set()
    for name, value in loaded.named_parameters(remove_duplicate=False):  # a tied one: under any of its names
        if name in trained:
            torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
            compared.add(id(value))
    assert compared == {id(p) for p in loaded.parameters()} and set(trained) <= set(loaded.state_dict())
    before = transformers.AutoModelForCausalLM.from_pretrained(str(source))
    assert not torch.equal(before.get_input_embeddings().weight, loaded.get_input_embeddings().weight)  # trained
    if kind == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied, written once
        assert "lm_head.weight" not in index["weight_map"]
    assert (out / "special_tokens_map.json").read_text() == (source / "special_tokens_map.json").read_text()
    exported = tmp_path / "exported"
    assert main(["export", str(tmp_path / "checkpoints"), str(exported)]) == 0  # the checkpoint of the same run
    assert _tensors(exported).keys() == _tensors(out).keys()
    for name, value in _tensors(exported).items():
        torch.testing.assert_close(value, _tensors(out)[name], rtol=0, atol=0, msg=name)
    assert (exported / "special_tokens_map.json").is_file() and (exported / "config.json").is_file()
    manifest = tmp_path / "checkpoints" / "step-000002" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "model": {"kind": "mlp"}}))
    capsys.readouterr()  # transformers' progress bars
    err = cli_error(["export", str(tmp_path / "checkpoints"), str(tmp_path / "other")])
    assert "its checkpoint is of --model mlp, not an hf: model; export writes" in err, err


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's shards, through its index."""
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return {k: v for shard in sorted(set(index["weight_map"].values())) for k, v in load_file(folder / shard).items()}


def test_a_folder_that_cannot_be_written_is_one_line(
    cli_error: Callable[..., str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _saved(tmp_path / "source", "gpt2")
    capsys.readouterr()  # save_pretrained's progress bar
    (tmp_path / "file").write_text("")
    argv = ["train", "--model", f"hf:{source}", "--seq-len", "8", "--steps", "1", "--quiet"]
    err = cli_error([*argv, "--save-pretrained", str(tmp_path / "file" / "out")], "pipeweave.runtime.run.launch._spawn")
    assert "--save-pretrained" in err and "is a file, not a folder; give another path" in err, err


def test_shards_of_an_hf_type_model_are_joined_with_its_config(tmp_path: Path) -> None:
    from pipeweave.models.export import finish, saved_names, shard_name, write_shard
    from pipeweave.models.hf import build_module

    entry, fields = "hf:gpt2", json.dumps(GPT2_FIELDS)
    module = build_module(entry, fields, seed=3)
    names = saved_names(entry, fields)
    state = {names[k]: v for k, v in module.state_dict().items() if k in names}
    assert "lm_head.weight" not in state  # tied: written once, under the embedding's name
    half = sorted(state)[: len(state) // 2]
    write_shard(tmp_path / shard_name(0, 3), {k: state[k] for k in half})
    write_shard(tmp_path / shard_name(1, 3), {})  # a rank whose tensors another wrote
    write_shard(tmp_path / shard_name(2, 3), {k: v for k, v in state.items() if k not in half})
    (tmp_path / "model-00001-of-00009.safetensors").write_text("")  # an earlier save's shard
    finish(entry, fields, str(tmp_path), 3)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [shard_name(0, 3), shard_name(2, 3)]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.config.n_embd == GPT2_FIELDS["n_embd"] and loaded.config.bos_token_id is None
    for name, value in module.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
    (tmp_path / shard_name(0, 3)).unlink()  # a rank that could not write
    with pytest.raises(UserError, match=r"model-00001-of-00003.safetensors was not written; save again"):
        finish(entry, fields, str(tmp_path), 3)
