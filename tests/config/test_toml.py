"""Configuration files: ``pipeweave train --config FILE.toml`` reads the fields (options override them),
``--print-config`` writes them back, every shipped example loads and equals its flags, and a bad key or
value is one line naming the file, the line and the fix -- before anything spawns."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from pipeweave.cli import main
from pipeweave.config import TrainConfig
from pipeweave.config.toml import dumps, loads

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
FLAGS = {  # each shipped file as the flags that say the same (shlex-split)
    "gpt.toml": "--model gpt --layers 4 --hidden 128 --heads 4 --seq-len 64 -s zb-h1 --stages 2 --microbatches 4 "
    "--batch 16 --steps 30",
    "3d.toml": "--model gpt --layers 4 --hidden 64 --heads 4 --seq-len 32 -s zb-h1 --stages 2 --microbatches 4 "
    "--batch 16 --data-parallel 2 --tensor-parallel 2 --zero 1 --steps 4 --optimizer adamw --lr 0.003 "
    "--clip-grad-norm 1.0 --transport gloo",
    "async.toml": "--model mlp --layers 8 --hidden 32 -s pipemare --stages 4 --microbatches 4 --warmup-steps 2 "
    "--batch 16 --steps 12 --optimizer sgd --lr 0.05 --anneal-steps 8 --decay 0.9",
    "llama.toml": "--model llama --layers 4 --hidden 128 --heads 8 --kv-heads 2 --seq-len 64 -s zb-h1 --stages 2 "
    "--microbatches 4 --batch 16 --recompute selective --steps 30",
    "hf.toml": "--model hf:gpt2 --hf-config "
    '\'{"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 64}\' '
    "--seq-len 32 -s 1f1b --stages 2 --microbatches 4 --batch 8 --steps 4",
    "zb-auto.toml": "--model gpt --layers 6 --hidden 64 --heads 4 --seq-len 32 -s zb-auto --stages 4 "
    "--microbatches 8 --batch 16 --activation-limit 1.5 --steps 4",
}


def _printed(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["train", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


def test_every_shipped_file_has_its_flags() -> None:
    assert sorted(FLAGS) == sorted(p.name for p in CONFIGS.glob("*.toml"))


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_a_shipped_file_equals_its_flags_and_round_trips(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from_file = _printed(capsys, ["--config", str(CONFIGS / name)])
    assert from_file == _printed(capsys, shlex.split(FLAGS[name]))
    assert loads(from_file, TrainConfig) == loads(dumps(loads(from_file, TrainConfig)), TrainConfig)


def test_options_override_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    text = _printed(capsys, ["--config", str(CONFIGS / "async.toml"), "--steps", "5", "--stages", "2"])
    config = loads(text, TrainConfig)
    assert (config.training.steps, config.schedule.num_stages, config.schedule.name) == (5, 2, "pipemare")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[schedule]\nnum_stagse = 3\n", "run.toml:2: num_stagse is no key of [schedule]; did you mean num_stages?"),
        ("[paralel]\ntensor_parallel = 2\n", "run.toml:1: [paralel] is no section; did you mean parallel?"),
        (
            '\n[parallel]\ntensor_parallel = "2"\n',
            "run.toml:3: [parallel] tensor_parallel='2' is a str; give an integer",
        ),
        ("[parallel]\nzero = 4\n", "run.toml:2: [parallel] --zero 4 is invalid; choose one of: 0, 1, 2, 3"),
        ('[training]\noptimizer = "lamb"\n', "run.toml:2: [training] --optimizer 'lamb' is unknown; choose one of"),
        ("[training\nsteps = 3\n", "run.toml: "),
    ],
)
def test_a_bad_file_is_one_line_and_nothing_spawns(tmp_path: Path, text: str, message: str, cli_error) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    err = cli_error(["train", "--config", str(path)], "pipeweave.runtime.run.launch.launch")
    assert message.replace("run.toml", str(path)) in err, err


def test_a_missing_file_is_one_line(tmp_path: Path, cli_error) -> None:
    err = cli_error(["train", "--config", str(tmp_path / "none.toml")])
    assert "cannot read it" in err


def test_every_run_leaves_the_file_that_reruns_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "train",
        "--model",
        "mlp",
        "--layers",
        "2",
        "--hidden",
        "8",
        "-s",
        "1f1b",
        "--steps",
        "2",
        "--batch",
        "8",
        "--quiet",
        "--out",
        str(out),
        "--transport",
        "gloo",
    ]
    assert main(argv) == 0
    first = json.loads((out / "train.json").read_text())["losses"]
    again = tmp_path / "again"
    assert main(["train", "--config", str(out / "train.json"), "--out", str(again)]) == 0
    assert json.loads((again / "train.json").read_text())["losses"] == first


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FLAGS))
def test_a_shipped_file_trains_as_its_flags(name: str, tmp_path: Path) -> None:
    """Same losses from the file as from the flags (each run short: --steps 2)."""
    losses = []
    for how, argv in (("file", ["--config", str(CONFIGS / name)]), ("flags", shlex.split(FLAGS[name]))):
        out = tmp_path / how
        assert main(["train", *argv, "--steps", "2", "--quiet", "--out", str(out)]) == 0
        losses.append(json.loads((out / "train.json").read_text())["losses"])
    assert losses[0] == losses[1] and len(losses[0]) == 2
