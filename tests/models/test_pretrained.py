"""``--model hf:PATH``: a folder written by ``save_pretrained`` trains from its weights, each rank reading its
parts' tensors alone (issue 32). Every model here is made in the test (``from_config`` + ``save_pretrained``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import transformers

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models.pretrained import Weights
from pipeweave.models.spec import ModelSpec

MODELS = Path(__file__).resolve().parent
sys.path.insert(0, str(MODELS))
from tiny_hf import saved_model, transformers_run  # noqa: E402

NOTHING_SPAWNED = ("pipeweave.runtime.run.launch._spawn",)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_model(tmp_path_factory.mktemp(request.param), request.param)


def test_each_layer_holds_the_files_tensors_and_reads_only_its_own(saved: Path) -> None:
    from safetensors import safe_open

    spec = ModelSpec(kind="custom", entry=f"hf:{saved}", seq_len=8)
    with safe_open(str(saved / "model.safetensors"), framework="pt") as f:
        files = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    read: list[str] = []
    real = type(safe_open(str(saved / "model.safetensors"), framework="pt"))
    for k, build in enumerate(spec.custom.layers):
        read.clear()
        with patch.object(Weights, "load", autospec=True, side_effect=_recording(Weights.load, read)):
            layer = build()
        state = layer.state_dict()
        for name, tensor in state.items():
            held = "transformer.wte.weight" if name == "lm_head.weight" and name not in files else name
            if held in files:  # (pipeweave's deferrable linears hold the same Parameters under other names)
                torch.testing.assert_close(tensor, files[held], rtol=0, atol=0, msg=f"layer {k} {name}")
        assert set(read) <= set(state), (k, real)


def _recording(load: Callable[..., dict[str, torch.Tensor]], read: list[str]) -> Callable[..., dict[str, torch.Tensor]]:
    def wrapped(self: Weights, names: list[str], alias: dict[str, str]) -> dict[str, torch.Tensor]:
        values = load(self, names, alias)
        read.extend(values)
        return values

    return wrapped


def test_sharded_weights_are_read_through_the_index(tmp_path: Path) -> None:
    folder = saved_model(tmp_path, "llama", shard="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    weights = Weights(folder)
    assert len(set(weights.file_of.values())) > 1
    own = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    spec = ModelSpec(kind="custom", entry=f"hf:{folder}", seq_len=8)
    loaded = {n: t for build in spec.custom.layers for n, t in build().state_dict().items()}
    for name, tensor in own.state_dict().items():
        if name in loaded:
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "schedule",
    ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow), pytest.param("interleaved-1f1b", marks=pytest.mark.slow)],
)
def test_trains_from_its_weights_as_transformers_own_model_in_a_plain_loop(
    saved: Path, schedule: str, tmp_path: Path
) -> None:
    from pipeweave.runtime.run.job import run_rank
    from pipeweave.runtime.run.launch import LaunchOptions, launch
    from pipeweave.runtime.run.prepare import prepare

    spec = ModelSpec(kind="custom", entry=f"hf:{saved}", seq_len=8)
    config = TrainConfig(
        schedule=schedule,
        num_stages=2,
        num_microbatches=4,
        batch_size=4,
        steps=3,
        quiet=True,
        out=str(tmp_path),
        model=spec,
        transport="gloo",
        **({"num_chunks": 2} if schedule == "interleaved-1f1b" else {}),
    )
    plan = prepare(config)
    record = launch(run_rank, plan, plan.num_processes, LaunchOptions(timeout_s=120))
    losses, _ = transformers_run(saved, config)
    torch.testing.assert_close(record.losses, losses, rtol=1e-5, atol=1e-6)


def _cli(folder: Path) -> list[str]:
    return ["train", "--model", f"hf:{folder}", "--seq-len", "8", "--steps", "1", "--quiet"]


def test_a_folder_that_cannot_serve_its_model_is_one_line(
    cli_error: Callable[..., str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    err = cli_error(_cli(bare), *NOTHING_SPAWNED)
    assert "has no config.json; give a folder written by save_pretrained" in err, err
    sharded, wrong = saved_model(tmp_path / "sharded", "llama", shard="20KB"), saved_model(tmp_path / "wrong", "gpt2")
    capsys.readouterr()  # save_pretrained's progress bar
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[-1]
    (sharded / missing).rename(tmp_path / "elsewhere")
    err = cli_error(_cli(sharded), *NOTHING_SPAWNED)
    assert f"names the shard {missing}, which is missing; copy it into" in err, err
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "n_embd": 32, "n_head": 4}))
    err = cli_error(_cli(wrong), *NOTHING_SPAWNED)
    assert "has shape [300, 16], the model of config.json [300, 32]" in err, err
    err = cli_error([*_cli(wrong), "--hf-config", '{"n_layer": 1}'], *NOTHING_SPAWNED)
    assert "whose config.json sets the model; drop --hf-config" in err, err
    err = cli_error(_cli(tmp_path / "nowhere" / "model"), *NOTHING_SPAWNED)
    assert "is no folder; give a folder written by save_pretrained" in err, err


def test_weights_without_safetensors_are_one_line(tmp_path: Path) -> None:
    folder = saved_model(tmp_path, "gpt2")
    (folder / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no model.safetensors or model.safetensors.index.json"):
        Weights(folder)
