"""``pipeweave plan --costs FILE``: a profiled model scaled to the target by the ratio of FLOP rates, predicted
as a GPT is (the GPT's own costs given as a profile give the GPT's prediction), and its bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeweave.cli import main
from pipeweave.errors import UserError
from pipeweave.partition import LayerCosts
from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster, activation_bytes, block_times, deferral_times, head_times
from pipeweave.planner.efficiency import A100_CALIBRATED
from pipeweave.planner.evaluate import Evaluator
from pipeweave.planner.evaluate_profiled import ProfiledEvaluator
from pipeweave.planner.hardware import GPU
from pipeweave.planner.memory import block_activation_bytes, part_parameters
from pipeweave.planner.profiled import ProfiledModel, profiled_model
from pipeweave.planner.transformer import Transformer
from pipeweave.schedule.registry import SCHEDULES

CliError = Callable[..., str]
GPT = Transformer(layers=8, hidden=1024, heads=16, seq_len=1024, vocab=4096)
GPU_ = GPU(name="custom", peak_flops=100e12, memory_bytes=80 * 2**30, intra_node=1e9, inter_node=1e8, gpus_per_node=2)


def _gpt_as_profile(model: Transformer, cluster: Cluster, num_parts: int, split: bool) -> LayerCosts:
    """The GPT's own TP-1 costs (``planner.costs``, ``planner.memory``) written as a profile of its blocks, for one
    sample: the embedding's parameters on the first block, the head's times, parameters and logits on the last;
    each block's output the activation between blocks, which a part's last block keeps (so less of the rest).
    ``split``: for a schedule that defers W, whose cost a profile's W holds (``runtime.profile`` times a deferred
    W), the GPT's W with it (``planner.costs.deferral_times``)."""
    block = block_times(cluster, tp=1, microbatch_size=1, recompute="none")
    head = head_times(cluster, tp=1, microbatch_size=1)
    deferral = deferral_times(cluster, tp=1, microbatch_size=1) if split else (0.0, 0.0)
    n = model.layers
    f, i, w = [block.f] * n, [block.i] * n, [block.w + deferral[0]] * n
    f[-1], i[-1], w[-1] = f[-1] + head[0], i[-1] + head[1], w[-1] + head[2] + deferral[1]
    params = [4.0 * model.layer_parameters] * n
    params[0] += 4.0 * model.embedding_parameters
    params[-1] += 4.0 * model.vocab * model.hidden
    held = block_activation_bytes(model, tp=1, recompute="none")[0]
    activation = [held] * (n - 1) + [held + 4.0 * model.seq_len * model.vocab]
    output = activation_bytes(model, 1)
    for k in range(n // num_parts - 1, n, n // num_parts):
        activation[k] -= output
    return LayerCosts(
        names=[f"layers.{k}" for k in range(n)],
        types=["Block"] * n,
        forward=f,
        input_grad=i,
        weight_grad=w,
        activation=activation,
        params=params,
        output=[output] * n,
        meta={"microbatch_size": 1},
    )


@pytest.mark.parametrize(
    "schedule, pp, chunks", [("1f1b", 4, 1), ("gpipe", 2, 1), ("interleaved-1f1b", 2, 2), ("zb-h1", 4, 1)]
)
def test_the_gpts_own_costs_as_a_profile_give_the_gpts_prediction(schedule: str, pp: int, chunks: int) -> None:
    cluster = Cluster(model=GPT, gpu=GPU_, efficiency=A100_CALIBRATED)
    profile = _gpt_as_profile(GPT, cluster, pp * chunks, SCHEDULES[schedule].splits_backward)
    model = ProfiledModel(costs=profile, profile_microbatch=1)
    assert model.part_parameters(pp * chunks) == part_parameters(GPT, pp * chunks)
    config = Config(
        tp=1, pp=pp, dp=2, chunks=chunks, microbatch_size=2, microbatches=8, schedule=schedule, recompute="none", zero=1
    )
    gpt = Evaluator(cluster=cluster, batch=32).evaluate(config)
    ours = ProfiledEvaluator(cluster=Cluster(model=model, gpu=GPU_, efficiency=A100_CALIBRATED), batch=32).evaluate(
        config
    )
    assert gpt is not None and ours is not None
    assert ours.step_time == pytest.approx(gpt.step_time, rel=1e-12)
    assert ours.bubble_ratio == pytest.approx(gpt.bubble_ratio, rel=1e-9)
    if schedule != "zb-h1":
        assert ours.memory.as_dict() == gpt.memory.as_dict()
    else:  # the profile counts a part between I and W as holding all it held: more
        assert ours.memory.total > gpt.memory.total


def test_times_scale_by_the_ratio_of_flop_rates_and_the_microbatch() -> None:
    costs = LayerCosts(
        **{**LayerCosts.uniform(4, f=1.0, b=2.0, w=1.0).to_json(), "flops": [2.0] * 4, "meta": {"microbatch_size": 2}}
    )
    # Profiled: 8 FLOPs in 16 s, 0.5 FLOP/s; the target: 10 FLOP/s x eta_max 0.5 = 5 FLOP/s, ten times faster.
    model = profiled_model(costs, target_flops=10.0, eta_max=0.5)
    assert model.scale == pytest.approx(0.1) and model.profile_microbatch == 2
    f, i, w = model.part_times(2, microbatch_size=4, recompute="none")
    assert f == pytest.approx((0.4, 0.4)) and i == pytest.approx((0.8, 0.8)) and w == pytest.approx((0.4, 0.4))
    f, i_full, w = model.part_times(2, microbatch_size=4, recompute="full")
    assert i_full == pytest.approx((1.2, 1.2))  # the replayed forward
    given = profiled_model(costs, target_flops=10.0, eta_max=0.5, rate=5.0)
    assert given.scale == pytest.approx(1.0)
    assert profiled_model(costs, target_flops=None, eta_max=0.5).scale == 1.0  # the profiling machine itself
    held, stash, during = model.part_activations(2, microbatch_size=4, recompute="full")
    assert held == (0.0, 0.0) and during == pytest.approx((4.0, 4.0))  # outputs 0: only the input is kept


def _profile_file(tmp_path: Path, flops: bool = True) -> str:
    costs = LayerCosts(
        **{
            **LayerCosts.uniform(6, f=1e-3, b=1e-3, w=1e-3).to_json(),
            "flops": [3e9 if flops else 0.0] * 6,
            "meta": {"microbatch_size": 4},
        }
    )
    path = tmp_path / "costs.json"
    costs.save(path)
    return str(path)


def test_plan_costs_on_a_gpu_and_on_the_profiling_machine(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _profile_file(tmp_path)
    argv = ["plan", "--costs", path, "--gpus", "4", "--global-batch", "32", "--json"]
    assert main([*argv, "--gpu", "a100-80gb"]) == 0
    a100 = json.loads(capsys.readouterr().out)
    rate = 6 * 3e9 / (6 * 3e-3)  # 1 TFLOP/s measured
    assert a100["model"]["time_scale"] == pytest.approx(rate / (312e12 * A100_CALIBRATED.eta_max))
    assert all(c["tp"] == 1 and c["recompute"] in ("none", "full") for c in a100["configurations"])
    assert (
        main(
            [
                *argv,
                "--gpu",
                "custom",
                "--memory-gib",
                "16",
                "--intra-node-gbps",
                "100",
                "--inter-node-gbps",
                "10",
                "--dispatch",
                "1e-4",
            ]
        )
        == 0
    )
    here = json.loads(capsys.readouterr().out)
    assert here["model"]["time_scale"] == 1.0 and here["gpu"]["peak_tflops"] == pytest.approx(1.0)
    best = here["configurations"][0]
    assert best["step_time_s"] > a100["configurations"][0]["step_time_s"] * 100


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--model", "gpt-1.7b"], ["--model describes a transformer", "give one of them"]),
        (["--attention", "math"], ["--attention describes a transformer", "give one of them"]),
        (["--tensor-parallel", "2"], ["runs with TP 1"]),
        (["--sequence-parallel"], ["--sequence-parallel applies to a GPT shape", "drop --sequence-parallel"]),
        (["--recompute", "selective"], ["recomputes none or full"]),
        (["--dispatch", "-1"], ["--dispatch -1.0 is invalid"]),
        (["--profile-tflops", "0"], ["--profile-tflops 0.0 is invalid"]),
    ],
)
def test_bad_profiled_input_is_one_line(
    cli_error: CliError, tmp_path: Path, extra: list[str], words: list[str]
) -> None:
    err = cli_error(["plan", "--costs", _profile_file(tmp_path), "--gpus", "4", "--global-batch", "32", *extra])
    assert all(w in err for w in words), err


def test_a_profile_without_flops_needs_the_rate(
    cli_error: CliError, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _profile_file(tmp_path, flops=False)
    err = cli_error(["plan", "--costs", path, "--gpus", "4", "--global-batch", "32"])
    assert "no counted FLOPs" in err and "--profile-tflops" in err
    assert (
        main(["plan", "--costs", path, "--gpus", "4", "--global-batch", "32", "--profile-tflops", "1", "--json"]) == 0
    )
    capsys.readouterr()
    err = cli_error(["plan", "--dispatch", "1e-3", "--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512"])
    assert "apply to a profiled model" in err


def test_times_interpolate_between_profiles_at_other_microbatch_sizes(cli_error: CliError, tmp_path: Path) -> None:
    small = LayerCosts(**{**LayerCosts.uniform(2, f=1.0, b=1.0, w=1.0).to_json(), "meta": {"microbatch_size": 2}})
    large = LayerCosts(**{**LayerCosts.uniform(2, f=3.0, b=3.0, w=3.0).to_json(), "meta": {"microbatch_size": 8}})
    model = profiled_model(small, target_flops=None, eta_max=0.5, others=(large,))
    f = [model.part_times(1, microbatch_size=b, recompute="none")[0][0] for b in (1, 2, 5, 8, 16)]
    # 2 layers: 2 s at b = 2 (so 1 s at b = 1), 6 s at 8 (12 s at 16), halfway between at 5.
    assert f == pytest.approx([1.0, 2.0, 4.0, 6.0, 12.0])
    with pytest.raises(UserError, match="two profiles at microbatch size"):
        profiled_model(small, target_flops=None, eta_max=0.5, others=(small,))
    other = LayerCosts(**{**LayerCosts.uniform(3).to_json(), "meta": {"microbatch_size": 8}})
    with pytest.raises(UserError, match="different models"):
        profiled_model(small, target_flops=None, eta_max=0.5, others=(other,))
    paths = []
    for k, costs in enumerate((small, other)):
        paths.append(str(tmp_path / f"{k}.json"))
        costs.save(paths[-1])
    err = cli_error(["plan", "--costs", *paths, "--gpus", "2", "--global-batch", "8", "--profile-tflops", "1"])
    assert "different models" in err
