"""Each partitioner on small cases computed by hand, and its errors."""

from __future__ import annotations

import pytest

from pipeweave.errors import UserError
from pipeweave.partition import PARTITIONERS, LayerCosts, MemoryProfile, PartitionContext, partition


def costs(**per_layer: list[float] | list[str]) -> LayerCosts:
    """Unit layers (f = b = w = 1, activation = params = 1) with some fields overridden."""
    n = len(next(iter(per_layer.values())))
    return LayerCosts(**{**LayerCosts.uniform(n).to_json(), **per_layer})


GPT_TYPES = ["Embedding", "Block", "Block", "Block", "Block", "Block", "Block", "Head"]


def test_registry_names() -> None:
    assert set(PARTITIONERS) == {"uniform", "parameters", "type", "time", "pipedream", "memory", "explicit"}


@pytest.mark.parametrize(
    ("layers", "parts", "expected"),
    [(7, 3, (3, 2, 2)), (8, 4, (2, 2, 2, 2)), (5, 5, (1,) * 5), (9, 2, (5, 4)), (3, 1, (3,))],
)
def test_uniform(layers: int, parts: int, expected: tuple[int, ...]) -> None:
    assert partition("uniform", LayerCosts.uniform(layers), parts).counts == expected


def test_parameters_balances_bytes_not_layers() -> None:
    # bytes 8 | 1 1 1 1 1 1 2: best bottleneck is 8, reached only by cutting after layer 0;
    # with 3 parts the bottleneck stays 8, and the time tie-break splits the other 7 layers 3 + 4
    # (the later part takes the extra layer on a tie).
    c = costs(params=[8, 1, 1, 1, 1, 1, 1, 2])
    assert partition("parameters", c, 2).counts == (1, 7)
    assert partition("parameters", c, 3).counts == (1, 3, 4)
    # a heavy layer in the middle: 1 1 1 9 1 1 -> 3 parts: (1 1 1) (9) (1 1).
    assert partition("parameters", costs(params=[1, 1, 1, 9, 1, 1]), 3).counts == (3, 1, 2)


def test_type_regex_balances_matching_layers() -> None:
    c = costs(types=GPT_TYPES)
    # six blocks over two parts, three each; embedding and head follow the time tie-break.
    assert partition("type:Block", c, 2).counts == (4, 4)
    parts = partition("type:block", c, 3)  # case-insensitive, as DeepSpeed's
    blocks = [sum(GPT_TYPES[i] == "Block" for i in parts.layers(k)) for k in range(3)]
    assert blocks == [2, 2, 2]


def test_type_regex_matches_names_too() -> None:
    c = costs(names=["emb", "h.0", "h.1", "h.2", "h.3", "head"], types=["X"] * 6)
    parts = partition(r"type:^h\.", c, 2)
    assert [sum(c.names[i].startswith("h.") for i in parts.layers(k)) for k in range(2)] == [2, 2]


def test_time_minimises_the_slowest_part() -> None:
    # F+I+W per layer: 3 3 3 3 3 3 3 15 (a heavy head), 36 in all. Two parts: 6 layers (18) |
    # one layer and the head (18); uniform's 4 | 4 would cost 12 | 24.
    c = costs(forward=[1] * 7 + [13])
    assert partition("time", c, 2).counts == (6, 2)
    # 3 parts: the head alone, the rest 4 + 3 layers (12 | 9 | 15) -> bottleneck 15.
    result = partition("time", c, 3)
    assert result.counts[-1] == 1 and max(c.time_of(a, b) for a, b in result.bounds) == 15


def test_time_ties_prefer_even_layer_counts() -> None:
    # layers of time 3 3 0 0 3 3 (two free layers): every split with cut at 2, 3 or 4 reaches 6.
    c = costs(forward=[1, 1, 0, 0, 1, 1], input_grad=[1, 1, 0, 0, 1, 1], weight_grad=[1, 1, 0, 0, 1, 1])
    assert partition("time", c, 2).counts == (3, 3)


def test_explicit() -> None:
    c = LayerCosts.uniform(8)
    ctx = PartitionContext(counts=(3, 2, 2, 1))
    assert partition("explicit", c, 4, ctx).counts == (3, 2, 2, 1)
    assert partition("explicit", c, 4, ctx).bounds == ((0, 3), (3, 5), (5, 7), (7, 8))


@pytest.mark.parametrize(
    ("counts", "fragment"),
    [
        ((3, 2, 2), "gives 3 parts for 4"),
        ((3, 2, 2, 2), "sums to 9 layers"),
        ((4, 0, 2, 2), "empty part"),
        (None, "needs"),
    ],
)
def test_explicit_errors(counts: tuple[int, ...] | None, fragment: str) -> None:
    with pytest.raises(UserError, match=fragment) as info:
        partition("explicit", LayerCosts.uniform(8), 4, PartitionContext(counts=counts))
    assert "\n" not in str(info.value)


def test_memory_gives_early_1f1b_stages_fewer_layers() -> None:
    # 8 unit layers, 4 parts; under 1F1B part k holds 4-k microbatches: memory = (4-k+1) x layers
    # with one weight copy and no optimizer state. Limit 9: layers <= 1, 2, 3, 4 -> least max is 3.
    c = LayerCosts.uniform(8)
    profile = MemoryProfile(activations=(4.0, 3.0, 2.0, 1.0), weights=(1.0,) * 4, state=0.0)
    result = partition("memory", c, 4, PartitionContext(memory_limit=9.0, profile=profile))
    assert result.counts == (1, 2, 2, 3)
    assert partition("time", c, 4).counts == (2, 2, 2, 2)  # which would need 5 x 2 = 10 > 9 on part 0


def test_memory_error_names_the_least_limit() -> None:
    profile = MemoryProfile(activations=(4.0, 3.0, 2.0, 1.0), weights=(1.0,) * 4, state=0.0)
    # at best part 0 holds one layer (5 bytes) and the rest 7 layers in 3 parts: (1, 2, 2, 3): 5 8 6 6.
    with pytest.raises(UserError, match=r"--memory-limit 7 bytes .* least any split needs \(8 bytes\)") as info:
        partition("memory", LayerCosts.uniform(8), 4, PartitionContext(memory_limit=7.0, profile=profile))
    assert "\n" not in str(info.value)


def test_memory_needs_a_limit_and_one_part_per_rank() -> None:
    with pytest.raises(UserError, match="--memory-limit"):
        partition("memory", LayerCosts.uniform(4), 2)
    looped = MemoryProfile(activations=(2.0, 2.0), weights=(1.0, 1.0), ranks=(0, 0))
    with pytest.raises(UserError, match="one part per rank"):
        partition("memory", LayerCosts.uniform(4), 2, PartitionContext(memory_limit=100.0, profile=looped))


@pytest.mark.parametrize(
    ("method", "parts", "fragment"),
    [
        ("uniform", 9, "9 parts for a model of 8 layers; use at most 8"),
        ("time", 0, "num_parts=0"),
        ("nonsense", 2, "unknown partition method 'nonsense'"),
        ("time:x", 2, "unknown partition method"),
        ("type:Conv", 2, "type:Conv matches no layer; the layer types are: Layer"),
        ("type:(", 2, "not a valid regular expression"),
        ("type:", 2, "needs a pattern"),
    ],
)
def test_impossible_cases_raise_one_line(method: str, parts: int, fragment: str) -> None:
    with pytest.raises(UserError, match=fragment.replace("(", r"\(")) as info:
        partition(method, LayerCosts.uniform(8), parts)
    assert "\n" not in str(info.value)


def test_costs_round_trip_and_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = costs(forward=[1, 2, 3], types=["A", "B", "C"])
    c.save(tmp_path / "c.json")
    assert LayerCosts.load(tmp_path / "c.json") == c
    with pytest.raises(UserError, match="forward has 2 values for 3 layers"):
        LayerCosts(**{**c.to_json(), "forward": [1, 2]})
    with pytest.raises(UserError, match="negative"):
        LayerCosts(**{**c.to_json(), "params": [1, -2, 3]})
    with pytest.raises(UserError, match="cannot read costs"):
        LayerCosts.load(tmp_path / "missing.json")
