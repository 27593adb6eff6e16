"""``--tensor-parallel``, ``--data-parallel``, ``--zero`` and the network flags of simulate, partition and search."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeweave.cli import main
from pipeweave.commands.partition import layer_bytes
from pipeweave.partition import LayerCosts, Partition

CliError = Callable[..., str]

# 1F1B, D=2, T=2, f=b=w=1: part 1's last W ends at 7, rank 0 computes until 9 (tests/sim/test_parallel.py).
# At 8 Gb/s = 1e9 B/s an all-reduce over P=2 of X bytes takes X / 1e9 s.
TINY_DP = ["--stages", "2", "--microbatches", "2", "--data-parallel", "2", "--intra-node-gbps", "8"]


def out_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_simulate_without_the_flags_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    plain = out_json(capsys, ["simulate", "-s", "zb-h1", "--time-comm", "0.25"])
    explicit = out_json(
        capsys,
        [
            "simulate",
            "-s",
            "zb-h1",
            "--time-comm",
            "0.25",
            "--tensor-parallel",
            "1",
            "--data-parallel",
            "1",
            "--zero",
            "0",
            "--param-bytes",
            "5e9",
        ],
    )
    assert plain == explicit and "layout" not in plain


@pytest.mark.parametrize("part1_bytes,makespan,exposed", [("2e9", 9.0, 0.0), ("5e9", 12.0, 3.0)])
def test_simulate_counts_only_the_dp_reduction_sticking_out(
    capsys: pytest.CaptureFixture[str], part1_bytes: str, makespan: float, exposed: float
) -> None:
    out = out_json(capsys, ["simulate", *TINY_DP, "--param-bytes", f"0,{part1_bytes}"])
    assert out["makespan"] == pytest.approx(makespan)
    assert out["layout"]["network"] == {
        "intra_node_bytes_per_s": 1e9,
        "inter_node_bytes_per_s": 1e9,
        "latency_s": 0.0,
        "gpus_per_node": 8,
    }
    comm = out["layout"]["communication"]
    assert comm["dp_reduction"] == pytest.approx([0.0, float(part1_bytes) / 1e9])
    assert comm["dp_exposed"] == pytest.approx(exposed)


def test_simulate_reports_tp_and_dp_communication_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    # N=2, P=2 on nodes of 2: TP inside a node (2400 Gb/s = 300e9 B/s), DP across (200 Gb/s = 25e9 B/s).
    assert (
        main(
            [
                "simulate",
                "--stages",
                "2",
                "--microbatches",
                "4",
                "--tensor-parallel",
                "2",
                "--data-parallel",
                "2",
                "--zero",
                "1",
                "--gpus-per-node",
                "2",
                "--intra-node-gbps",
                "2400",
                "--inter-node-gbps",
                "200",
                "--message-bytes",
                "3e8",
                "--param-bytes",
                "1e9",
                "--optimizer-state",
                "3",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "layout: TP=2 x DP=2, ZeRO 1" in text
    # 2 all-reduces of 3e8 B over 2 ranks in each F and B, 8 actions on rank 0: 16 x 1 ms
    assert "TP all-reduces per step, busiest rank 16.000 ms" in text
    # reduce-scatter of 1e9 / 2 B over P=2 across nodes: 1/2 x 5e8 / 25e9 = 10 ms
    assert "DP gradient reduction per part, max 10.000 ms" in text
    # 1e9 B per part / N=2; gradients the same; Adam's 2e9 B / (N P)
    assert (
        "model state per GPU (largest rank): 1.40 GiB = parameters 476.84 MiB + gradients 476.84 MiB + "
        "optimizer 476.84 MiB"
    ) in text


def test_search_searches_the_layouts_times(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["search", "--stages", "2", "--microbatches", "4", "--solver", "heuristic"]
    one = out_json(capsys, base)
    two = out_json(capsys, [*base, "--tensor-parallel", "2"])
    assert "layout" not in one and two["span"] == one["span"] / 2
    assert two["layout"]["makespan"] == pytest.approx(two["makespan"])
    # with sequence parallelism a hop of 2e9 B at 8 Gb/s (1e9 B/s) takes 1 s instead of 2: the searched step shrinks
    sent = [
        *base,
        "--tensor-parallel",
        "2",
        "--intra-node-gbps",
        "8",
        "--message-bytes",
        "2e9",
        "--tp-collectives",
        "0",
    ]
    plain, sp = out_json(capsys, sent), out_json(capsys, [*sent, "--sequence-parallel", "--activation-bytes", "8"])
    assert (
        sp["layout"]["communication"]["pipeline_hop"] == 1.0 and plain["layout"]["communication"]["pipeline_hop"] == 2.0
    )
    assert sp["makespan"] < plain["makespan"]
    # 8 B of activations per microbatch split over N = 2: 4 B per M_a of the found schedule's peaks
    assert sp["layout"]["activations_per_rank"] == [4.0 * m for m in sp["peak_activations"]]


# 1F1B, D = 2, T = 4, N = 2: rank 0 holds 2 microbatches at its peak, rank 1 one. Per microbatch and GPU,
# 8e9 B of activations of which 4e9 B are whole on each TP rank: 4e9 / 2 + 4e9 = 6e9 B, with SP 8e9 / 2 = 4e9 B.
# A pipeline message of 1e9 B at 8 Gb/s (1e9 B/s): 1 s, with SP each rank's half, 0.5 s.
SP_RUN = [
    "simulate",
    "--stages",
    "2",
    "--microbatches",
    "4",
    "--tensor-parallel",
    "2",
    "--intra-node-gbps",
    "8",
    "--message-bytes",
    "1e9",
    "--tp-collectives",
    "0",
    "--activation-bytes",
    "8e9",
    "--replicated-activation-bytes",
    "4e9",
]


def test_simulate_shows_what_sequence_parallelism_does_to_memory_and_step(capsys: pytest.CaptureFixture[str]) -> None:
    plain, sp = out_json(capsys, SP_RUN), out_json(capsys, [*SP_RUN, "--sequence-parallel"])
    assert set(plain) <= set(sp) and set(plain["layout"]) <= set(sp["layout"])  # keys added, none renamed
    assert (plain["layout"]["sequence_parallel"], sp["layout"]["sequence_parallel"]) == (False, True)
    assert plain["layout"]["activations_per_rank"] == [12e9, 6e9]
    assert sp["layout"]["activations_per_rank"] == [8e9, 4e9]
    assert sp["layout"]["activations_per_rank_without_sequence_parallel"] == [12e9, 6e9]
    assert sp["layout"]["communication"]["pipeline_hop"] == plain["layout"]["communication"]["pipeline_hop"] / 2 == 0.5
    assert sp["peak_activations"] == plain["peak_activations"]  # the timeline's M_a units are the cost model's
    # 1F1B's 2 (D - 1) hops on the critical path, and the 4 x 2 sends in between hidden behind compute or not
    assert sp["makespan"] < plain["makespan"]
    assert main([*SP_RUN, "--sequence-parallel"]) == 0
    text = capsys.readouterr().out
    assert "layout: TP=2 x DP=1, ZeRO 0, sequence parallel" in text
    assert "activations per GPU (peak, largest rank): 7.45 GiB; without sequence parallelism 11.18 GiB (x0.667)" in text


@pytest.fixture
def blocks(tmp_path: Path) -> Path:
    """Four blocks of f = b = w = 1 s, 8 B of parameters each, no activation memory."""
    path = tmp_path / "costs.json"
    LayerCosts(
        names=[f"blocks.{i}" for i in range(4)],
        types=["Block"] * 4,
        forward=[1.0] * 4,
        input_grad=[1.0] * 4,
        weight_grad=[1.0] * 4,
        activation=[0.0] * 4,
        params=[8.0] * 4,
    ).save(path)
    return path


@pytest.mark.parametrize(
    "flags,memory,makespan",
    [
        ([], 64.0, 18.0),  # 16 B of parameters per part x (1 copy + 3 of gradient and Adam's state)
        (["--tensor-parallel", "2", "--data-parallel", "2"], 32.0, 9.0),  # all / N; compute / N
        (["--tensor-parallel", "2", "--data-parallel", "2", "--zero", "1"], 24.0, 9.0),  # Adam's 32 B / (N P)
        (["--tensor-parallel", "2", "--data-parallel", "2", "--zero", "3"], 16.0, 9.0),  # everything / (N P)
    ],
)
def test_partition_predicts_memory_per_gpu_and_step(
    capsys: pytest.CaptureFixture[str], blocks: Path, flags: list[str], memory: float, makespan: float
) -> None:
    out = out_json(
        capsys,
        ["partition", "--costs", str(blocks), "--stages", "2", "--microbatches", "2", "--optimizer-state", "3", *flags],
    )
    assert [p["memory"] for p in out["parts"]] == [memory, memory]
    assert out["makespan"] == makespan
    assert [p["time"] for p in out["parts"]] == [
        makespan / 3
    ] * 2  # F + I + W of a part, on one GPU: (T+D-1) = 3 of them
    assert ("layout" in out) == bool(flags)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tensor-parallel", "0"], "--tensor-parallel 0 is invalid; give an integer >= 1"),
        (["--data-parallel", "0"], "--data-parallel 0 is invalid; give an integer >= 1"),
        (["--zero", "2"], "--zero 2 is invalid; give 0 (replicated), 1"),
        (["--intra-node-gbps", "-1"], "--intra-node-gbps -1 is invalid; give a finite bandwidth > 0 in Gb/s"),
        (["--inter-node-gbps", "nan"], "--inter-node-gbps nan is invalid"),
        (["--gpus-per-node", "0"], "--gpus-per-node 0 is invalid"),
        (["--link-latency-us", "-5"], "--link-latency-us -5 is invalid; give finite microseconds >= 0"),
        (
            ["--data-parallel", "4", "--intra-node-gbps", "100"],
            "--inter-node-gbps is missing: the 16 ranks span 2 nodes",
        ),
        (["--inter-node-gbps", "100"], "--intra-node-gbps is missing with --gpus-per-node 8"),
        (["--param-bytes", "1,2,3"], "--param-bytes has 3 values but the schedule has 4 parts"),
        (["--message-bytes", "big"], "--message-bytes 'big' is not a number; give one number of bytes"),
        (["--tp-collectives", "-1"], "--tp-collectives '-1' has a negative count"),
        (["--optimizer-state", "inf"], "--optimizer-state inf is invalid"),
        (
            ["--sequence-parallel"],
            "--sequence-parallel shards activations over the tensor-parallel group; give --tensor-parallel N > 1",
        ),
        (
            ["--sequence-parallel", "--tensor-parallel", "2", "--data-parallel", "2", "--zero", "1"],
            "--sequence-parallel with --zero 1 is not supported (pipeweave train refuses it); drop one of them",
        ),
        (
            ["--sequence-parallel", "--tensor-parallel", "2", "--tied"],
            "--sequence-parallel with --tied is not supported",
        ),
        (
            ["--activation-bytes", "4", "--replicated-activation-bytes", "5"],
            "--replicated-activation-bytes 5 is more than --activation-bytes 4; give at most the activation bytes",
        ),
        (["--activation-bytes", "nan"], "--activation-bytes nan is invalid; give a finite number of bytes >= 0"),
    ],
)
def test_simulate_refuses_bad_values_in_one_line(cli_error: CliError, argv: list[str], needle: str) -> None:
    work = ("pipeweave.commands.simulate.simulate", "pipeweave.commands.simulate.simulate_layout")
    assert needle in cli_error(["simulate", *argv], *work)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--zero", "3", "--tensor-parallel", "-2"], "--tensor-parallel -2 is invalid"),
        (["--zero", "4"], "--zero 4 is invalid"),
    ],
)
def test_partition_refuses_bad_values_before_profiling(cli_error: CliError, argv: list[str], needle: str) -> None:
    err = cli_error(["partition", "--stages", "2", *argv], "pipeweave.commands.partition.layer_costs")
    assert needle in err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tensor-parallel", "0"], "--tensor-parallel 0 is invalid"),
        (["--message-bytes", "1,2"], "--message-bytes 1,2 is a list; the search takes one value"),
        (
            ["--sequence-parallel", "--tensor-parallel", "1"],
            "--sequence-parallel shards activations over the tensor-parallel group; give --tensor-parallel N > 1",
        ),
    ],
)
def test_search_refuses_bad_values_in_one_line(cli_error: CliError, argv: list[str], needle: str) -> None:
    err = cli_error(["search", "--stages", "2", "--microbatches", "4", *argv], "pipeweave.autoschedule.exact")
    assert needle in err


def test_partition_balances_the_layers_times_on_the_layout(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # An embedding of f = b = w = 4 s and four blocks of 1 s: alone, [embedding] | [4 blocks] (12 s each).
    # At N=2 with each all-reduce of a block's 1e9 B output taking 1 s (8 Gb/s = 1e9 B/s, 2(2-1)/2 x 1e9),
    # a block costs (1 + 1 + 1) / 2 + 4 all-reduces = 5.5 s and the embedding 6 s: [embedding, block] | [3 blocks]
    # (11.5 | 16.5 s), where [embedding] | [4 blocks] would be 6 | 22 s.
    path = tmp_path / "costs.json"
    LayerCosts(
        names=["embedding"] + [f"blocks.{i}" for i in range(4)],
        types=["Embedding"] + ["Block"] * 4,
        forward=[4.0] + [1.0] * 4,
        input_grad=[4.0] + [1.0] * 4,
        weight_grad=[4.0] + [1.0] * 4,
        activation=[0.0] * 5,
        params=[1.0] * 5,
        output=[1e9] * 5,
    ).save(path)
    argv = ["partition", "--costs", str(path), "--stages", "2", "--partition", "time"]
    assert [len(p["layers"]) for p in out_json(capsys, argv)["parts"]] == [1, 4]
    on_tp = out_json(capsys, [*argv, "--tensor-parallel", "2", "--intra-node-gbps", "8"])
    assert [len(p["layers"]) for p in on_tp["parts"]] == [2, 3]
    assert [p["time"] for p in on_tp["parts"]] == pytest.approx([6.0 + 5.5, 3 * 5.5])


def test_profiled_layers_give_their_tp_traffic_by_type() -> None:
    costs = LayerCosts(
        names=["embedding", "blocks.0", "blocks.1", "head"],
        types=["Embedding", "Block", "Block", "Head"],
        forward=[1.0] * 4,
        input_grad=[1.0] * 4,
        weight_grad=[1.0] * 4,
        activation=[0.0] * 4,
        params=[100.0, 20.0, 20.0, 50.0],
        output=[10.0, 10.0, 10.0, 80.0],
    )
    parts = layer_bytes(costs, Partition((2, 2)), 3.0).for_parts(num_parts=2, num_ranks=2)
    assert parts.message == (10.0, 80.0) and parts.tp_message == (10.0, 10.0)  # the blocks' activation
    assert parts.tp_forward == (2.0, 2.0) and parts.tp_backward == (2.0, 3.0)  # the head: 1 backward
    assert parts.tp_gather == (0.0, 80.0)  # the head's logits
    assert parts.params == (120.0, 70.0) and parts.replicated == (100.0, 0.0)  # the embedding, whole
    assert (parts.grads, parts.optimizer) == (1.0, 2.0)
