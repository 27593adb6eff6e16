"""``pipeweave plan`` at any size: counts up to 10^9 GPUs and 10^12 samples answer in seconds, with a plan or one
line naming the largest count that works; a model no count can fit is told what would fit, never "more GPUs".

Before, ``--gpus 65536`` walked 8 x 65536 nearby counts (minutes), ``--gpus 1000000000`` built a list of a
billion groups (past 1.7 GB), and ``--global-batch 1000000000000`` walked its divisors one by one (a hang).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable

import pytest

from pipeweave.cli import main
from pipeweave.planner.costs import Cluster
from pipeweave.planner.efficiency import A100_CALIBRATED
from pipeweave.planner.floor import floor_bytes
from pipeweave.planner.hardware import gpu_named
from pipeweave.planner.space import MAX_CELLS, Fixed, cells_per_microbatch, configurations, divisors
from pipeweave.planner.transformer import Transformer, model_named
from pipeweave.schedule import generate
from pipeweave.schedule.registry import SCHEDULES

CliError = Callable[..., str]
QUICK = 10.0
"""Seconds: a guard against a hang, not a speed target."""


def _timed_error(cli_error: CliError, *argv: str) -> str:
    started = time.perf_counter()
    err = cli_error(["plan", "--model", "gpt-1.7b", *argv])
    assert time.perf_counter() - started < QUICK, err
    return err


def test_divisors_take_the_square_root() -> None:
    rng = random.Random(0)
    for n in [1, 2, 36, 97, 720720, *(rng.randrange(1, 10**5) for _ in range(50))]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    started = time.perf_counter()
    assert len(divisors(963761198400)) == 6720  # the most divisors below 10^12
    assert time.perf_counter() - started < QUICK


@pytest.mark.parametrize("gpus", ["65536", "1000000000"])
def test_more_gpus_than_any_split_uses_is_one_line_with_the_largest(cli_error: CliError, gpus: str) -> None:
    err = _timed_error(cli_error, "--global-batch", "64", "--gpus", gpus)
    # TP 8 (a node, dividing 24 heads) x PP 24 (the layers) x DP 64 (the batch)
    assert f"--gpus {gpus} is more than any split uses" in err and "give --gpus 12288 or fewer" in err, err


def test_the_nearest_counts_come_from_the_splits_not_a_walk(cli_error: CliError) -> None:
    err = _timed_error(cli_error, "--global-batch", "1000000000000", "--gpus", "999999937")  # a prime
    # 10^9 (DP 10^9), 4 x 5^12 (TP 4, DP 5^12), 1.024 x 10^9 (TP 8, PP 8, DP 2^4 5^9)
    assert "999999937 GPUs split into no TP x PP x DP" in err, err
    assert "give --gpus 1000000000 or 976562500 or 1024000000" in err, err


def test_the_nearest_counts_are_those_a_walk_would_find() -> None:
    from pipeweave.planner.diagnose import split_counts

    cluster = Cluster(model=model_named("gpt-1.7b"), gpu=gpu_named("a100-80gb"), efficiency=A100_CALIBRATED)
    for batch in (48, 64, 100):
        counts = split_counts(cluster, batch, Fixed())
        usable = {n for n in range(1, counts.largest + 1) if _splits(n, batch)}
        assert counts.largest == max(usable)
        for gpus in (7, 13, 97, 1000, counts.largest - 1):
            walk = sorted(usable - {gpus}, key=lambda n: (abs(n - gpus), n))[:3]
            assert counts.nearest(gpus) == walk, (batch, gpus)
            assert counts.at_least(gpus) == min(n for n in usable if n >= gpus), (batch, gpus)


def test_more_gpus_are_advised_as_a_count_that_splits(cli_error: CliError) -> None:
    err = cli_error(["plan", "--model", "gpt-1t", "--gpus", "8", "--global-batch", "64", "--grads", "bf16"])
    assert "give about 32x the GPUs (--gpus 256)" in err, err  # 30x is 240, which no TP x PP x DP makes
    err = cli_error(["plan", "--model", "gpt-1t", "--gpus", "8", "--global-batch", "64"])  # FP32 main gradients
    # 34x is 272, which no TP x PP x DP makes; 304 is TP 8 x PP 19 x DP 2, 128 blocks on 19 stages (133 slots)
    assert "give about 38x the GPUs (--gpus 304)" in err, err


def _splits(gpus: int, batch: int) -> bool:
    """gpt-1.7b on nodes of 8: TP 1, 2, 4, 8; PP dividing 24, or 5 (5 blocks on 4 stages, 4 on one: 25 block slots,
    within ``space.UNEVEN_SLACK``); DP dividing the batch."""
    depths = [*divisors(24), 5]
    return any(gpus % (tp * pp) == 0 and batch % (gpus // (tp * pp)) == 0 for tp in (1, 2, 4, 8) for pp in depths)


def test_a_batch_of_a_trillion_is_one_line_naming_the_largest_batch(cli_error: CliError) -> None:
    err = _timed_error(cli_error, "--gpus", "64", "--global-batch", "1000000000000")
    assert f"a step simulates at most {MAX_CELLS} (part, microbatch) pairs" in err, err
    assert "give --global-batch 2097152 or less" in err, err  # DP 64 x 32768 microbatches of one sample


def test_a_space_too_large_to_bound_is_one_line(cli_error: CliError) -> None:
    err = _timed_error(cli_error, "--gpus", "64", "--global-batch", "720720")  # 240 divisors: 112,086 configurations
    assert "make more than 50000 configurations" in err and "--microbatch-size" in err, err


@pytest.mark.slow
def test_a_billion_gpus_and_a_trillion_samples_answer_within_the_time_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model", "gpt-1.7b", "--gpus", "1000000000", "--global-batch", "1000000000000", "--time-limit", "2"]
    started = time.perf_counter()
    assert main(["plan", *argv, "--json"]) == 0
    seconds = time.perf_counter() - started
    out = json.loads(capsys.readouterr().out)
    best = out["configurations"][0]
    assert best["tp"] * best["pp"] * best["dp"] == 10**9 and best["fits"], best
    search = out["search"]
    assert search["unsettled"] > 0 and search["unsettled_bound_s"] <= best["step_time_s"], search
    assert seconds < 6 * QUICK, seconds  # ~7 s of CPU: the 36,459 bounds, then 2 s of simulation


def test_a_model_no_count_fits_is_told_what_would(cli_error: CliError) -> None:
    shape = ["--model", "gpt", "--layers", "24", "--hidden", "2304", "--heads", "24", "--seq-len", "131072"]
    shape += ["--attention", "math"]  # the stored s x s scores: what makes a long sequence fit nowhere
    started = time.perf_counter()
    err = cli_error(["plan", *shape, "--gpus", "64", "--global-batch", "64"])
    assert time.perf_counter() - started < QUICK
    assert "fits on no count of GPUs" in err and "give --seq-len 72413 or shorter" in err, err
    assert "the GPUs" not in err and "--gpus" not in err, err  # never "give about 4x the GPUs"
    gpu = gpu_named("a100-80gb")

    def floor(seq_len: int) -> float:
        model = Transformer(layers=24, hidden=2304, heads=24, seq_len=seq_len, attention="math")
        return floor_bytes(Cluster(model=model, gpu=gpu, efficiency=A100_CALIBRATED))

    assert floor(72413) <= gpu.memory_bytes < floor(72414)


def test_the_floor_is_below_every_configuration() -> None:
    model = Transformer(layers=4, hidden=512, heads=8, seq_len=4096, vocab=8192)
    cluster = Cluster(model=model, gpu=gpu_named("a100-80gb"), efficiency=A100_CALIBRATED)
    from pipeweave.planner.evaluate import Evaluator

    evaluator, floor = Evaluator(cluster=cluster, batch=16), floor_bytes(cluster)
    space = list(configurations(model, 16, 16, 8, Fixed()))
    for config in random.Random(1).sample(space, 40):
        result = evaluator.evaluate(config, time_unfit=True)
        assert result is None or result.memory.total >= floor, config.label


def test_the_space_proposes_zero_only_where_the_runtime_shards() -> None:
    # the runtime's rule (runtime.run.prepare._check_zero): ZeRO needs one stage per part in a pipeline
    sharded = {}
    for name, info in SCHEDULES.items():
        if info.synchronous:
            schedule = generate(name, num_stages=4, num_microbatches=8, num_chunks=None if info.chunks else 2)
            sharded[name] = schedule.placement.num_stages == schedule.placement.num_parts
    space = list(configurations(model_named("gpt-1.7b"), 64, 64, 8, Fixed()))
    proposed = {c.schedule for c in space if c.zero}
    assert proposed and all(sharded[name] for name in proposed), proposed - {n for n, ok in sharded.items() if ok}
    assert {"chimera", "gems", "dualpipe"} & {c.schedule for c in space} and not {
        "chimera",
        "gems",
        "dualpipe",
    } & proposed


def test_every_configuration_stays_within_the_simulated_size() -> None:
    space = list(configurations(model_named("gpt-1.7b"), 64, 2**22, 8, Fixed()))
    assert space and all(cells_per_microbatch(c.schedule, c.pp, c.chunks) * c.microbatches <= MAX_CELLS for c in space)
    assert min(c.microbatch_size for c in space) == math.ceil(2**22 / (64 * MAX_CELLS))


def test_the_time_limit_stops_the_search_and_says_what_is_left(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gpt-1.7b", "--gpus", "64", "--global-batch", "256", "--time-limit", "1e-9"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "stopped at --time-limit:" in out and "configurations not simulated, none faster than" in out, out
    assert main([*argv, "--json"]) == 0
    search = json.loads(capsys.readouterr().out)["search"]
    assert search["unsettled"] > 0 and search["bounded"] == 0, search


def test_the_links_of_a_mesh_are_those_of_every_group() -> None:
    # The planner asks for the links of meshes of up to 10^9 ranks: one period of groups stands for all of them.
    from pipeweave.sim import parallel
    from pipeweave.sim.network import Link, Network, slowest_link

    rng = random.Random(2)
    for _ in range(400):
        per_node, tp, dp, pp = rng.choice([1, 2, 3, 4, 8]), rng.randint(1, 8), rng.randint(1, 8), rng.randint(2, 8)
        net = Network(intra_node=Link(bandwidth=2.0), inter_node=Link(bandwidth=1.0), gpus_per_node=per_node)
        layout, mesh = parallel.Layout(tp=tp, dp=dp, network=net), parallel.Layout(tp=tp, dp=dp).mesh(num_ranks=pp)
        every = (slowest_link(net, mesh.tp_groups()), slowest_link(net, mesh.dp_groups()))
        assert parallel._group_links(layout, pp) == every
        a, b = rng.randrange(pp), rng.randrange(pp)
        assert layout.hop_link(a, b, num_ranks=pp) == slowest_link(net, mesh.hop_pairs(a, b))
        both = (a, pp - 1 - a) if a != pp - 1 - a else (0, pp - 1)
        groups = [[mesh.rank(dp=d, pp=h, tp=t) for d in range(dp) for h in both] for t in range(tp)]
        assert parallel._reduction_group(layout, pp, tuple(sorted(both))) == (2 * dp, slowest_link(net, groups))
    started = time.perf_counter()  # a billion ranks: before, a list of 125 million groups (past 1.7 GB)
    net = Network(intra_node=Link(bandwidth=2.0), inter_node=Link(bandwidth=1.0), gpus_per_node=8)
    huge = parallel.Layout(tp=8, dp=125_000_000, network=net)
    assert parallel._group_links(huge, 1) == (net.intra_node, net.inter_node)
    assert parallel.gather_time(huge, 1e6, num_ranks=1, holders=(0,)) == 0.0  # ZeRO 0: nothing gathered
    assert time.perf_counter() - started < QUICK


def test_a_fixed_dimension_that_no_count_fits_is_given_its_value_that_would(cli_error: CliError) -> None:
    err = _timed_error(cli_error, "--gpus", "64", "--global-batch", "64", "--microbatch-size", "1000000000000")
    assert "fits on no count of GPUs" in err and "give --microbatch-size 1 (3.2 GiB)" in err, err
    shape = ["--model", "gpt", "--layers", "24", "--hidden", "2304", "--heads", "24", "--seq-len", "32768"]
    shape += ["--attention", "math"]
    err = cli_error(["plan", *shape, "--gpus", "64", "--global-batch", "64", "--tensor-parallel", "1"])
    assert "give --tensor-parallel 8 (" in err and "--seq-len 25095 or shorter" in err, err
