"""The GPU presets: every figure a datasheet gives, each preset's source named, and a plan on each."""

from __future__ import annotations

import json

import pytest

from pipeweave.cli import main
from pipeweave.planner import hardware
from pipeweave.planner.hardware import GIB, GPUS

NAMES = {
    "a100-40gb": "A100 40GB",
    "a100-80gb": "A100 80GB",
    "h100-sxm": "H100 SXM5",
    "h100-pcie": "H100 PCIe",
    "h200": "H200",
    "b200": "B200",
    "mi300x": "MI300X",
}


def test_every_preset_names_its_source() -> None:
    assert set(GPUS) == set(NAMES)
    doc = hardware.__doc__ or ""
    for name, datasheet in NAMES.items():
        assert f"- {datasheet}" in doc, name  # its own paragraph: the datasheet and the figures taken from it


@pytest.mark.parametrize(
    "name, tflops, gib, tbps",
    [
        ("a100-40gb", 312, 40, 1.555),
        ("h100-pcie", 756, 79.6, 2.0),
        ("b200", 2250, 179, 8.0),
        ("mi300x", 1307, 191.7, 5.3),
    ],
)
def test_presets_carry_dense_bf16_memory_and_bandwidth(name: str, tflops: float, gib: float, tbps: float) -> None:
    gpu = GPUS[name]
    assert gpu.peak_flops == tflops * 1e12 and gpu.memory_bytes / GIB == pytest.approx(gib, abs=0.1)
    assert gpu.memory_bandwidth == tbps * 1e12 and gpu.gpus_per_node == 8


def test_a_plan_on_a_faster_gpu_is_faster(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--tensor-parallel", "8"]
    steps = {}
    for name in ("h100-pcie", "h100-sxm", "b200", "mi300x"):
        assert main([*argv, "--stages", "1", "--gpu", name, "--json"]) == 0
        steps[name] = json.loads(capsys.readouterr().out)["configurations"][0]["step_time_s"]
    assert steps["b200"] < steps["h100-sxm"] < steps["h100-pcie"] and steps["mi300x"] < steps["h100-sxm"]
