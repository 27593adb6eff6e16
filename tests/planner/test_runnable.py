"""Plans that run: every configuration ``plan`` proposes is one ``pipeweave train`` accepts for the model (its
own checks, ``runtime.run.prepare``, nothing spawned), every row carries the command, and the top plan of a
small model trains through its printed command."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from pipeweave.cli import build_parser, main
from pipeweave.commands.train_run import build_config
from pipeweave.errors import UserError
from pipeweave.planner.candidate import Config
from pipeweave.planner.runnable import refusal, train_zero_stages
from pipeweave.planner.transformer import MODELS, Transformer
from pipeweave.runtime.run.prepare import prepare

TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--vocab", "256"]


def plan_rows(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert main(["plan", *argv, "--json", "--all", "--time-limit", "0"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)["configurations"]
    return rows


def accepted(command: str) -> None:
    """``train``'s own checks of ``command`` (parsing, resolving, ``prepare``), nothing trained."""
    words = shlex.split(command)
    assert words[:2] == ["pipeweave", "train"]
    prepare(build_config(build_parser().parse_args(words[1:])))


@pytest.mark.parametrize(
    "model",
    [
        ["--model", "gpt", *TINY],
        ["--model", "llama", *TINY, "--kv-heads", "2", "--ffn-hidden", "96"],
        ["--model", "gpt", *TINY, "--sequence-parallel"],
        [
            "--model",
            "llama",
            *TINY,
            "--kv-heads",
            "2",
            "--ffn-hidden",
            "96",
            "--moe-experts",
            "4",
            "--expert-parallel",
            "2",
        ],
    ],
    ids=["gpt", "llama", "gpt-sequence-parallel", "llama-experts"],
)
def test_every_proposed_configuration_is_one_train_accepts(
    capsys: pytest.CaptureFixture[str], model: list[str]
) -> None:
    rows = plan_rows(capsys, *model, "--gpus", "4", "--global-batch", "4", "--gpus-per-node", "4")
    assert len(rows) > 10
    seen = set()
    for row in rows:
        assert row["refused_by_train"] is None and row["train_command"].startswith("pipeweave train ")
        shape = (*(row[k] for k in ("schedule", "pp", "chunks", "tp", "zero", "ep")), row["recompute"] == "selective")
        if shape not in seen:  # train's checks once per shape of what they check
            seen.add(shape)
            accepted(row["train_command"])


def test_what_train_refuses_is_never_proposed(capsys: pytest.CaptureFixture[str]) -> None:
    tied = ["--model", "gpt", *TINY, "--gpus", "4", "--global-batch", "8", "--gpus-per-node", "4"]
    assert {r["zero"] for r in plan_rows(capsys, *tied)} == {0, 1}  # no ZeRO 3 with the tied head
    assert not any(r["tp"] > 1 for r in plan_rows(capsys, *tied, "--sequence-parallel"))  # nor SP with a tie
    untied = ["--model", "llama", *TINY, "--gpus", "4", "--global-batch", "8", "--gpus-per-node", "4"]
    assert {r["zero"] for r in plan_rows(capsys, *untied)} == set(train_zero_stages()) - {2}  # 2 does not pay here
    # a value fixed that train refuses is still evaluated, each row saying why train refuses it
    (row, *_) = plan_rows(capsys, *tied, "--zero", "3", "--data-parallel", "2")
    assert row["train_command"] is None and "--zero 3 with a tied head" in row["refused_by_train"]
    with pytest.raises(UserError, match="--zero 3 with tied parameters"):
        accepted(
            "pipeweave train --model gpt --layers 4 --hidden 64 --heads 4 --seq-len 32 --vocab 256 "
            "--tie-embeddings -s 1f1b --stages 1 --microbatches 2 --batch 8 --data-parallel 2 --zero 3"
        )


def test_refusals_name_the_fix() -> None:
    base = Config(
        tp=2, pp=1, dp=2, chunks=1, microbatch_size=1, microbatches=4, schedule="1f1b", recompute="none", zero=0
    )
    untied = Transformer(name="llama", layers=4, hidden=64, heads=4, vocab=255, tied=False)
    assert refusal(base, untied) is not None and "--vocab" in str(refusal(base, untied))
    assert refusal(base, MODELS["gpt-1.7b"]) is None
    assert "--sequence-parallel" in str(refusal(base, MODELS["gpt-1.7b"], sequence_parallel=True))


def test_the_table_prints_each_rows_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt", *TINY, "--gpus", "2", "--global-batch", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith(("#1 pipeweave train", "#2 pipeweave train", "#3 pipeweave"))]
    assert len(lines) == 3, out


@pytest.mark.slow  # a 2-rank training run: ~30 s on a loaded 2-core machine
def test_the_top_plan_of_a_small_model_trains_through_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    (top, *_) = plan_rows(capsys, "--model", "gpt", *TINY, "--gpus", "2", "--global-batch", "8", "--stages", "2")
    words = shlex.split(top["train_command"])
    assert main([*words[1:], "--steps", "2", "--quiet"]) == 0


ZERO2 = ["--model", "llama", *TINY[2:], "--layers", "8", "--kv-heads", "2", "--ffn-hidden", "96"]
ZERO2_FIXED = ["--gpus", "4", "--global-batch", "8", "-s", "interleaved-1f1b", "--stages", "2", "--data-parallel", "2"]


def test_zero_2_is_proposed_where_it_pays_and_train_accepts_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Four parts per GPU (v = 4) over P = 2 replicas: ZeRO 2 holds 4/2 + 1 + 1/2 = 3.5 parts' gradients,
    ZeRO 1 four. Proposed there, each such row with a command ``train`` accepts, and less memory than ZeRO 1's
    row of the same shape; at v = 2 it would hold 3 against 2, and is not proposed."""
    rows = plan_rows(capsys, *ZERO2, *ZERO2_FIXED)
    zero2 = [r for r in rows if r["zero"] == 2]
    assert zero2 and all(r["chunks"] == 4 for r in zero2)
    shape = ("microbatch_size", "chunks", "recompute", "tp")
    for row in zero2:
        accepted(row["train_command"])
        (one,) = (r for r in rows if r["zero"] == 1 and all(r[k] == row[k] for k in shape))
        assert row["memory"]["grads"] <= one["memory"]["grads"]  # GiB to 3 places (exact: test_costs)


@pytest.mark.slow  # a 4-rank training run
def test_a_zero_2_plan_trains_through_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    (top, *_) = plan_rows(capsys, *ZERO2, *ZERO2_FIXED, "--zero", "2", "--chunks", "4")
    words = shlex.split(top["train_command"])
    assert "--zero" in words and words[words.index("--zero") + 1] == "2"
    assert main([*words[1:], "--steps", "2", "--quiet"]) == 0
