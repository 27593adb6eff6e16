"""The exact partitioners (time, memory, parameters, pipedream) equal brute force on random small instances."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from pipeweave.errors import UserError
from pipeweave.partition import LayerCosts, MemoryProfile, PartitionContext, partition, pipedream_plan, plan_time
from pipeweave.partition.problem import Partition


def splits(total: int, num_parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``num_parts`` positive integers summing to ``total``."""
    for cuts in itertools.combinations(range(1, total), num_parts - 1):
        edges = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(edges, edges[1:]))


def random_costs(rng: np.random.Generator, n: int) -> LayerCosts:
    """Random integer costs, so that ties are exact and common."""
    draw = lambda high: rng.integers(0, high, n).tolist()  # noqa: E731
    return LayerCosts(
        names=[f"layers.{i}" for i in range(n)],
        types=["Block"] * n,
        forward=[1 + x for x in draw(5)],
        input_grad=draw(6),
        weight_grad=draw(4),
        activation=[1 + x for x in draw(8)],
        params=draw(9),
        output=draw(5),
    )


def bottleneck(costs: LayerCosts, counts: tuple[int, ...], name: str) -> float:
    return max(costs.total(name, a, b) for a, b in Partition(counts).bounds)


def memories(costs: LayerCosts, counts: tuple[int, ...], profile: MemoryProfile) -> list[float]:
    return [profile.memory_of(costs, k, a, b) for k, (a, b) in enumerate(Partition(counts).bounds)]


CASES = [(seed, n, k) for seed in range(6) for n, k in [(5, 2), (7, 3), (8, 4), (9, 5), (6, 6), (6, 1)]]


@pytest.mark.parametrize(("seed", "n", "k"), CASES)
def test_time_and_parameters_equal_brute_force(seed: int, n: int, k: int) -> None:
    costs = random_costs(np.random.default_rng(seed), n)
    for method, field in [("time", "time"), ("parameters", "params")]:
        got = partition(method, costs, k).counts
        assert sum(got) == n and len(got) == k and min(got) >= 1
        assert bottleneck(costs, got, field) == min(bottleneck(costs, c, field) for c in splits(n, k))


@pytest.mark.parametrize(("seed", "n", "k"), [c for c in CASES if c[2] > 1])
def test_memory_equals_brute_force_under_the_limit(seed: int, n: int, k: int) -> None:
    rng = np.random.default_rng(100 + seed)
    costs = random_costs(rng, n)
    # a 1F1B-like profile: part k holds K-k microbatches, plus one weight copy and SGD's gradient.
    profile = MemoryProfile(activations=tuple(float(k - p) for p in range(k)), weights=(1.0,) * k, state=1.0)
    least = min(max(memories(costs, c, profile)) for c in splits(n, k))
    widest = max(max(memories(costs, c, profile)) for c in splits(n, k))
    for limit in np.linspace(least, widest, 4):
        fits = [c for c in splits(n, k) if max(memories(costs, c, profile)) <= limit]
        got = partition("memory", costs, k, PartitionContext(memory_limit=float(limit), profile=profile)).counts
        assert max(memories(costs, got, profile)) <= limit
        assert bottleneck(costs, got, "time") == min(bottleneck(costs, c, "time") for c in fits)
        # never worse than the other partitioners' splits that happen to fit
        for other in ("uniform", "time", "parameters"):
            counts = partition(other, costs, k).counts
            if max(memories(costs, counts, profile)) <= limit:
                assert bottleneck(costs, got, "time") <= bottleneck(costs, counts, "time")
    with pytest.raises(UserError, match="least any split needs"):
        partition("memory", costs, k, PartitionContext(memory_limit=least * 0.999, profile=profile))


def pipedream_brute_force(costs: LayerCosts, ranks: int, bandwidth: float) -> float:
    best = np.inf
    for parts in range(1, min(ranks, costs.num_layers) + 1):
        for counts in splits(costs.num_layers, parts):
            for replicas in splits(ranks, parts):
                best = min(best, plan_time(costs, Partition(counts, replicas), bandwidth=bandwidth))
    return float(best)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("bandwidth", [0.5, 4.0, 1e9])
def test_pipedream_equals_brute_force(seed: int, bandwidth: float) -> None:
    rng = np.random.default_rng(200 + seed)
    n, ranks = int(rng.integers(1, 7)), int(rng.integers(1, 6))
    costs = random_costs(rng, n)
    value, plan = pipedream_plan(costs, ranks, bandwidth=bandwidth)
    assert sum(plan.counts) == n and sum(plan.replicas) == ranks
    assert plan_time(costs, plan, bandwidth=bandwidth) == pytest.approx(value)
    assert value == pytest.approx(pipedream_brute_force(costs, ranks, bandwidth))


def test_pipedream_pays_for_cuts_and_replicas() -> None:
    # Two layers of time 3 on two ranks. A cut sends 10 bytes each way, a replica syncs 2 x 1 byte.
    two = LayerCosts(**{**LayerCosts.uniform(2).to_json(), "output": [10.0, 0.0], "params": [1.0, 1.0]})
    # bandwidth 1: the cut costs 2 x 10 = 20, replication max(6, 4 x 1 x 2 / 2) / 2 = 3 -> replicate.
    value, plan = pipedream_plan(two, 2, bandwidth=1.0)
    assert (value, plan.counts, plan.replicas) == (3.0, (2,), (2,))
    # bandwidth 1e6: the cut is free, both plans cost 3; a stage per rank is as good.
    assert pipedream_plan(two, 2, bandwidth=1e6)[0] == 3.0
