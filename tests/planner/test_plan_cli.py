"""``pipeweave plan``: the table, --json's fields best first, fixed dimensions, --plot, --explain, and bad input
as one line saying what would make it fit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeweave.cli import main
from pipeweave.planner.space import Fixed, configurations
from pipeweave.planner.transformer import MODELS

CliError = Callable[..., str]

SMALL = ["--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512"]
FIELDS = {
    "tp",
    "pp",
    "dp",
    "chunks",
    "microbatch_size",
    "microbatches",
    "schedule",
    "recompute",
    "zero",
    "step_time_s",
    "tflops_per_gpu",
    "mfu",
    "bubble_ratio",
    "memory_gib",
    "fits",
}


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["plan", *argv, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_json_has_the_fields_best_first(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, *SMALL)
    configs = out["configurations"]
    assert isinstance(configs, list) and len(configs) >= 10
    assert set(configs[0]) >= FIELDS
    fitting = [c for c in configs if c["fits"]]
    assert configs[: len(fitting)] == fitting
    assert [c["step_time_s"] for c in fitting] == sorted(c["step_time_s"] for c in fitting)
    assert all(c["tp"] * c["pp"] * c["dp"] == 32 for c in configs)
    assert all(c["microbatches"] * c["microbatch_size"] * c["dp"] == 512 for c in configs)


def test_the_search_returns_the_exhaustive_top(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--model",
        "gpt",
        "--layers",
        "8",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--seq-len",
        "1024",
        "--gpus",
        "16",
        "--global-batch",
        "64",
        "--top",
        "5",
        "--time-limit",
        "0",  # exact, however loaded the machine
    ]
    pruned = plan_json(capsys, *argv)["configurations"]
    every = plan_json(capsys, *argv, "--all")["configurations"]
    assert isinstance(pruned, list) and isinstance(every, list) and len(every) > len(pruned)
    assert [c["step_time_s"] for c in pruned[:5]] == [c["step_time_s"] for c in every[:5]]


def test_fixed_dimensions_evaluate_one_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(
        capsys,
        "--model",
        "gpt-39b",
        "--gpus",
        "512",
        "--global-batch",
        "1536",
        "--tensor-parallel",
        "8",
        "--stages",
        "2",
        "--microbatch-size",
        "4",
        "-s",
        "1f1b",
        "--recompute",
        "full",
        "--zero",
        "0",
        "--no-dp-overlap",
    )
    configs = out["configurations"]
    assert isinstance(configs, list) and len(configs) == 1
    c = configs[0]
    assert (c["dp"], c["microbatches"], c["fits"]) == (32, 12, True)
    assert c["tflops_per_gpu"] == pytest.approx(138, rel=0.15)  # Megatron-LM's Table 1


def test_table_explain_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    picture = tmp_path / "plan.png"
    assert main(["plan", *SMALL, "--explain", "--plot", str(picture), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s/GPU" in out and "#2 TP" in out and "mostly" in out and picture.stat().st_size > 1000
    terms = ["BF16 weights", "FP32 main-gradient buffer", "FP32 master weights", "Adam's two moments"]
    terms += ["activations", "CUDA context", "largest collective's workspace", "allocator fragmentation (5 %)"]
    assert all(t in out for t in terms), out
    times = ["GEMMs", "element-wise kernels", "recomputation", "head and loss", "pipeline bubble", "DP reduction"]
    times += ["optimizer step", "ZeRO all-gather", "past the pipeline's end"]
    line = next(x for x in out.splitlines() if x.startswith("time of #1's step"))
    assert all(t in line for t in times), line
    assert "not modelled for this run:" in out and "- kernel launches" in out, out


def test_what_is_not_modelled_follows_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    gpt = plan_json(capsys, *SMALL, "--tensor-parallel", "1", "--stages", "1", "--zero", "0")["not_modelled"]
    assert isinstance(gpt, list) and not any("TP collectives" in e or "FlashAttention" in e for e in gpt), gpt
    assert any("contention of the DP reduction" in e for e in gpt), gpt
    llama = ["--model", "llama3-8b", "--gpus", "16", "--global-batch", "16", "--gpu", "h100-sxm"]
    fixed = ["--tensor-parallel", "8", "--stages", "2", "-s", "zb-h1", "--zero", "0"]
    out = plan_json(capsys, *llama, *fixed)["not_modelled"]
    assert isinstance(out, list)
    for words in ("FlashAttention's causal skipping", "TP collectives", "h100-sxm's own"):
        assert any(words in e for e in out), (words, out)
    assert not any("W deferral" in e for e in out), out  # its re-reads are modelled (planner.costs)
    assert not any("uneven" in e for e in out), out  # the head's stage is balanced (planner.split): modelled


def test_zero_2_shards_the_gradients_as_train_holds_them(capsys: pytest.CaptureFixture[str]) -> None:
    """One part per GPU, P = 32, T = 4: ZeRO 2 keeps the gradient in 1/32 slices, and the part's whole gradient
    with its slice while a backward runs (``train --zero 2``): 1/32 + 1 + 1/32 of ZeRO 1's whole; ZeRO 1's
    reduce-scatter once per microbatch; the optimizer step zeroes only the gradients' slice."""
    fixed = ["--tensor-parallel", "1", "--stages", "1", "--microbatch-size", "4"]
    one, two = (plan_json(capsys, *SMALL, *fixed, "--zero", z)["configurations"][0] for z in ("1", "2"))
    assert two["memory"]["grads"] == pytest.approx(one["memory"]["grads"] * (1 + 2 / 32), rel=1e-3)
    assert two["memory"]["master"] == one["memory"]["master"]
    assert two["terms_s"]["DP reduction"] == pytest.approx(4 * one["terms_s"]["DP reduction"])
    assert two["terms_s"]["optimizer step"] < one["terms_s"]["optimizer step"]


def test_zero_2_is_searched_only_where_it_holds_less_than_zero_1() -> None:
    """v parts per GPU over P replicas: ZeRO 2 holds v/P + 1 + 1/P parts' gradients, ZeRO 1 v."""
    searched = list(configurations(MODELS["gpt-1.7b"], 32, 512, 8, Fixed()))
    assert {c.zero for c in searched} == {0, 1, 2, 3}
    for c in searched:
        pays = c.chunks / c.dp + 1 + 1 / c.dp < c.chunks
        assert (c.zero == 2) <= pays, c
        assert pays <= any(o.zero == 2 for o in searched if o.chunks == c.chunks and o.dp == c.dp), c


def test_custom_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(
        capsys,
        *SMALL,
        "--gpu",
        "custom",
        "--peak-tflops",
        "624",
        "--memory-gib",
        "80",
        "--intra-node-gbps",
        "2400",
        "--inter-node-gbps",
        "200",
    )
    slow = plan_json(capsys, *SMALL)
    assert out["configurations"][0]["step_time_s"] < slow["configurations"][0]["step_time_s"]  # type: ignore[index]


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            [
                "--model",
                "gpt",
                "--layers",
                "24",
                "--hidden",
                "2304",
                "--heads",
                "24",
                "--gpus",
                "7",
                "--global-batch",
                "512",
            ],
            ["7 GPUs split into no TP x PP x DP", "cutting the 24 layers evenly or nearly", "give --gpus 6 or 8"],
        ),
        (
            ["--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512", "--tensor-parallel", "5"],
            ["does not divide the 24 heads", "give one of [1, 2, 4, 8]"],
        ),
        (
            ["--model", "gpt-1t", "--gpus", "8", "--global-batch", "64"],
            ["fits on no split of 8 GPUs", "give about", "--gpus"],
        ),
        (
            [
                "--model",
                "gpt",
                "--layers",
                "64",
                "--hidden",
                "16380",
                "--heads",
                "7",
                "--gpus",
                "8",
                "--global-batch",
                "8",
                "--vocab",
                "1024",
            ],
            ["7 heads allow TP up to 1 only"],
        ),
        (["--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512", "-s", "pipedream"], ["not a synchronous"]),
        (["--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512", "--peak-tflops", "100"], ["--gpu custom"]),
        (["--model", "llama2", "--gpus", "32", "--global-batch", "512"], ["unknown --model 'llama2'", "llama3-8b"]),
        (
            ["--model", "llama", "--layers", "4", "--hidden", "512", "--heads", "8", "--kv-heads", "3"]
            + ["--gpus", "8", "--global-batch", "8"],
            ["--kv-heads 3 does not divide --heads 8", "give a divisor"],
        ),
        (
            ["--model", "llama", "--layers", "4", "--hidden", "512", "--heads", "8", "--ffn-hidden", "0"]
            + ["--gpus", "8", "--global-batch", "8"],
            ["--ffn-hidden 0 is invalid"],
        ),
        (["--model", "llama", "--gpus", "32", "--global-batch", "512"], ["--model llama needs --layers --hidden"]),
        (["--model", "llama3-8b", "--layers", "4", "--gpus", "8", "--global-batch", "8"], ["changes the preset"]),
        (["--model", "gpt", "--gpus", "32", "--global-batch", "512"], ["--model gpt needs --layers --hidden --heads"]),
    ],
)
def test_bad_input_is_one_line_saying_what_would_fit(cli_error: CliError, argv: list[str], words: list[str]) -> None:
    err = cli_error(["plan", *argv])
    assert all(w in err for w in words), err
