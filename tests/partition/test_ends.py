"""Uneven first and last parts: Megatron-LM's first/last pipeline stage block counts, Llama 3's one block fewer
there, and the time and memory partitioners weighing the embedding and the head."""

from __future__ import annotations

import pytest

from pipeweave.config import PartitionConfig
from pipeweave.errors import UserError
from pipeweave.partition import LayerCosts, MemoryProfile, PartitionContext, partition


def test_llama3_one_block_fewer_on_the_first_and_last_stage() -> None:
    # 126 blocks on 16 stages: 7 (and the embedding), 8 x 14, 7 (and the head): 128 layers as train cuts them
    plan = partition("uniform", LayerCosts.uniform(128), 16, PartitionContext(first=7, last=7, ends=1))
    assert plan.counts == (8,) * 16
    assert sum(plan.counts) == 128


@pytest.mark.parametrize(
    ("first", "last", "expected"),
    [
        (1, None, (2, 3, 3, 4)),  # 10 blocks: 1 first, the other 9 as evenly (the last one with its head)
        (None, 0, (5, 3, 3, 1)),  # the head alone on the last stage, 4 + 3 + 3 blocks before it
        (0, 0, (1, 5, 5, 1)),  # the embedding alone, the head alone
        (2, 3, (3, 3, 2, 4)),  # 5 blocks between: the first of them takes the extra one
    ],
)
def test_first_and_last_blocks_the_rest_shared_evenly(
    first: int | None, last: int | None, expected: tuple[int, ...]
) -> None:
    context = PartitionContext(first=first, last=last, ends=1)
    assert partition("uniform", LayerCosts.uniform(12), 4, context).counts == expected


def test_a_stack_of_layers_counts_layers() -> None:
    assert partition("uniform", LayerCosts.uniform(7), 3, PartitionContext(last=1)).counts == (3, 3, 1)


@pytest.mark.parametrize(
    ("parts", "context", "fragment"),
    [
        (2, PartitionContext(first=3, last=3, ends=1), "give 6 blocks to the only 2 parts, the model has 10"),
        (4, PartitionContext(first=5, last=4, ends=1), "leave 1 of the model's 10 blocks for the other 2 part(s)"),
        (1, PartitionContext(first=1, ends=1), "needs at least 2 parts"),
        (3, PartitionContext(first=0), "give at least 1 layer"),
    ],
)
def test_counts_that_do_not_add_up_are_one_line(parts: int, context: PartitionContext, fragment: str) -> None:
    with pytest.raises(UserError, match="--(first|last)-stage-layers") as error:
        partition("uniform", LayerCosts.uniform(12), parts, context)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_first_and_last_apply_to_uniform_only() -> None:
    with pytest.raises(UserError, match="--first-stage-layers applies to --partition uniform, not --partition time"):
        PartitionConfig(method="time", first_stage_layers=3)
    with pytest.raises(UserError, match="not --layers-per-stage"):
        PartitionConfig(method="uniform", last_stage_layers=3, layers_per_stage=(3, 3))
    with pytest.raises(UserError, match="--first-stage-layers -1 is invalid"):
        PartitionConfig(first_stage_layers=-1)


def _transformer(head: float, head_params: float) -> LayerCosts:
    """An embedding (cheap, V x h parameters), 8 unit blocks and a head of ``head`` blocks' time."""
    n = 10
    unit = LayerCosts.uniform(n).to_json()
    forward = [0.01] + [1.0] * 8 + [head]
    return LayerCosts(
        **{
            **unit,
            "types": ["Embedding"] + ["Block"] * 8 + ["Head"],
            "forward": forward,
            "input_grad": forward,
            "weight_grad": forward,
            "params": [head_params] + [1.0] * 8 + [head_params],
        }
    )


def test_time_counts_the_head_a_large_vocabulary_weighs() -> None:
    # a head of 2 blocks' time (a 128k x h head at small h): the last part takes 2 blocks fewer than the others
    assert partition("time", _transformer(2.0, 1.0), 2).counts == (6, 4)  # 5 blocks + embedding, 3 + head
    assert partition("time", _transformer(0.01, 1.0), 2).counts == (5, 5)  # a small head: even


def test_memory_counts_the_embedding_and_head_weights() -> None:
    # no activations, the limit binding on weights: V x h weighs 3 blocks on the first and on the last part
    profile = MemoryProfile(activations=(0.0,) * 3, weights=(1.0,) * 3, state=0.0)
    costs = _transformer(0.01, 3.0)
    plan = partition("memory", costs, 3, PartitionContext(memory_limit=5.0, profile=profile))
    assert plan.counts == (3, 4, 3)  # the embedding + 2 blocks, 4 blocks, 2 blocks + the head: 5 bytes each


def test_train_resolves_the_first_and_last_stage_blocks() -> None:
    from config_defaults import train_config

    from pipeweave.models import ModelSpec
    from pipeweave.runtime.run.resolve import resolve

    llama = ModelSpec(kind="llama", layers=10, hidden=16, heads=2, seq_len=8)
    config = resolve(train_config(model=llama, num_stages=4, first_stage_layers=1, last_stage_layers=1))
    assert config.partition.layers_per_part == (2, 4, 4, 2)  # 1 block + embedding, 8 shared, 1 block + head
    looped = train_config(model=llama, schedule="interleaved-1f1b", num_stages=2, num_chunks=2, last_stage_layers=4)
    assert resolve(looped).partition.layers_per_part == (3, 2, 2, 5)  # the model's last part, on rank 1


def test_partition_command_counts_a_transformers_blocks(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from pipeweave.cli import main

    costs = tmp_path / "costs.json"
    LayerCosts.uniform(12).save(costs)
    argv = ["partition", "--model", "gpt", "--layers", "10", "--costs", str(costs), "--stages", "4", "--json"]
    assert main([*argv, "--first-stage-layers", "1"]) == 0
    parts = json.loads(capsys.readouterr().out)["parts"]
    assert [len(p["layers"]) for p in parts] == [2, 3, 3, 4]
    assert main([*argv, "--partition", "time", "--last-stage-layers", "1"]) == 2
    assert "--last-stage-layers applies to --partition uniform, not --partition time" in capsys.readouterr().err
