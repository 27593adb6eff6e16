"""Uneven stages in the planner: the split balancing the head and the embedding, chosen where it pays, a layer
count that does not divide the stages split unevenly (never refused), the split printed and trained."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeweave.cli import main
from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster
from pipeweave.planner.efficiency import A100_CALIBRATED
from pipeweave.planner.evaluate import Evaluator
from pipeweave.planner.hardware import GPUS
from pipeweave.planner.search import search
from pipeweave.planner.space import Fixed, configurations
from pipeweave.planner.split import balanced_blocks, candidate_blocks, even_blocks, runtime_counts
from pipeweave.planner.transformer import LLAMA, MODELS, Transformer

BLOOM = MODELS["bloom-176b"]  # 70 blocks, a 250,880-word head


def _cluster(model: Transformer) -> Cluster:
    return Cluster(model=model, gpu=GPUS["a100-80gb"], efficiency=A100_CALIBRATED)


def _bloom_on_12(blocks: tuple[int, ...]) -> Config:
    return Config(
        tp=8, pp=12, dp=1, chunks=1, microbatch_size=1, microbatches=96, schedule="1f1b", recompute="none",
        zero=0, blocks=blocks,
    )  # fmt: skip


def test_a_250880_word_vocabulary_on_12_stages_gets_an_uneven_split_with_less_bubble() -> None:
    even, balanced = candidate_blocks(BLOOM, 12, "none")
    assert even == even_blocks(70, 12) == (6,) * 10 + (5, 5)  # 70 does not divide by 12: split, not refused
    assert balanced[-1] < even[-1] and sum(balanced) == 70  # the head's stage holds fewer blocks
    evaluator = Evaluator(cluster=_cluster(BLOOM), batch=96)
    got = {blocks: evaluator.evaluate(_bloom_on_12(blocks)) for blocks in (even, balanced)}
    assert all(r is not None and r.fits for r in got.values())
    assert got[balanced].bubble_ratio < got[even].bubble_ratio  # type: ignore[union-attr]
    assert got[balanced].step_time < got[even].step_time  # type: ignore[union-attr]
    # the search keeps it: the best 1F1B of BLOOM on 12 stages is the uneven split
    space = configurations(BLOOM, 96, 96, 8, Fixed(tp=8, pp=12, schedule="1f1b", recompute="none"))
    best = search(space, evaluator, top=1).best[0]
    assert best.config.blocks == balanced


def test_a_head_that_weighs_little_keeps_the_even_split_alone() -> None:
    assert candidate_blocks(MODELS["gpt3-175b"], 8, "none") == [()]  # a 50,257 x 12,288 head: a third of a block
    assert balanced_blocks(MODELS["gpt-1t"], 16) == (8,) * 16
    assert candidate_blocks(MODELS["gpt-1.7b"], 4, "none") == [(), (5, 7, 7, 5)]  # its head: 1.6 blocks


def test_llama3_8b_on_4_stages_is_offered_one_block_fewer_on_the_first_and_last() -> None:
    assert candidate_blocks(MODELS["llama3-8b"], 4, "none") == [(), (7, 9, 9, 7)]
    assert runtime_counts((7, 9, 9, 7)) == (8, 9, 9, 8)  # train's --layers-per-stage: embedding and head added


def test_126_layers_on_16_stages_are_planned() -> None:
    model = replace(MODELS["llama3-405b"], name="llama-126")
    space = list(configurations(model, 16 * 8, 16, 8, Fixed(tp=8, pp=16, schedule="1f1b", microbatch_size=1)))
    assert space and all(sum(c.blocks) == 126 and len(c.blocks) == 16 for c in space)


def test_plan_prints_and_writes_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "bloom-176b", "--gpus", "96", "--global-batch", "96", "--tensor-parallel", "8"]
    argv += ["--stages", "12", "-s", "1f1b", "--recompute", "none", "--microbatch-size", "1"]
    assert main(argv) == 0
    assert "6x11,4" in capsys.readouterr().out  # the blocks per stage, folded
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["configurations"][0]["blocks"] == [6] * 11 + [4]


def test_a_tiny_llama_of_126_layers_plans_on_16_stages() -> None:
    model = Transformer(name="llama", layers=126, hidden=16, heads=2, vocab=256, seq_len=8, **LLAMA)
    space = configurations(model, 16, 16, 8, Fixed(pp=16, schedule="1f1b"))
    best = search(space, Evaluator(cluster=_cluster(model), batch=16), top=1).best[0]
    assert sum(best.config.blocks) == 126 and len(best.config.blocks) == 16


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_llama_of_126_layers_trains_on_16_stages_with_the_split_the_planner_chose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = ["--model", "llama", "--layers", "126", "--hidden", "16", "--heads", "2", "--seq-len", "8"]
    plan = ["plan", *shape, "--vocab", "256", "--gpus", "16", "--stages", "16", "--global-batch", "16"]
    assert main([*plan, "-s", "1f1b", "--microbatch-size", "1", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["configurations"][0]
    blocks = best["blocks"] or even_blocks(126, 16)
    counts = ",".join(map(str, runtime_counts(blocks)))
    record = tmp_path / "record.json"
    train = [sys.executable, "-m", "pipeweave.cli", "train", *shape, "-s", "1f1b", "--stages", "16"]
    # --timeout: 16 ranks on a loaded machine of 2 cores wait longer than 25 s for a peer
    train += ["--microbatches", str(best["microbatches"]), "--batch-size", "16", "--steps", "2", "--timeout", "300"]
    train += ["--layers-per-stage", counts, "--out", str(tmp_path / "out"), "--json", str(record)]
    run = subprocess.run(train, capture_output=True, text=True, timeout=800, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(record.read_text())
    assert report["losses"][-1] < report["losses"][0]
    weights = report["weight_bytes"]  # each rank holds its blocks, the first the embedding, the last the head
    per_block = weights[1] // blocks[1]
    assert all(weights[k] == blocks[k] * per_block for k in range(1, 15))
    assert weights[0] - blocks[0] * per_block == 256 * 16 * 4  # the token embedding, float32


def test_the_bounds_of_two_splits_are_their_own() -> None:
    from pipeweave.planner.bound import reduction_bound, time_bound

    # the even split, and one with 8 blocks beside the embedding: its first part reduces the most gradients
    even, heavy = (replace(_bloom_on_12(b), dp=2) for b in (even_blocks(70, 12), (8,) + (6,) * 10 + (2,)))
    shared = Evaluator(cluster=_cluster(BLOOM), batch=192)
    for config in (even, heavy):  # the second asked after the first: no answer of the first reused
        alone = Evaluator(cluster=_cluster(BLOOM), batch=192)
        assert reduction_bound(config, shared) == reduction_bound(config, alone)
        assert time_bound(config, shared) == time_bound(config, alone)
    assert reduction_bound(heavy, shared) > reduction_bound(even, shared)
