"""A tensor-parallel rank materialises only its shard of a meta-built layer (issue 32): from pretrained files it
reads only its slice of each split tensor, initialised it keeps the slice of the whole tensor the seeded rule
gives, and its peak while building is its share, not the layer."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeweave.models import pretrained
from pipeweave.models.build import build_layers
from pipeweave.models.pretrained import Weights
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.stage.tensor_parallel import cut_over, split, split_of
from pipeweave.runtime.transport.mesh import MEASURING, TensorParallel

pytestmark = pytest.mark.slow  # several processes, transformers' models: the slow set (.ci/run)

MODELS = Path(__file__).resolve().parent
sys.path.insert(0, str(MODELS))
from tiny_hf import GPT2, LLAMA, saved_model  # noqa: E402

SIZE = 2


def _whole_then_split(spec: ModelSpec, index: int, rank: int) -> dict[str, torch.Tensor]:
    """Layer ``index`` built whole, then cut as before this change: the shards every rank must equal."""
    (layer,) = build_layers(spec, [index])
    plan = spec.custom.tp_plan[index] or {}
    return dict(split(layer, plan, TensorParallel(MEASURING, rank, SIZE), f"layer {index}").named_parameters())


def _shard_built(spec: ModelSpec, index: int, rank: int) -> dict[str, torch.Tensor]:
    (layer,) = build_layers(spec, [index], cut_over(spec, TensorParallel(MEASURING, rank, SIZE)))
    return dict(layer.named_parameters())


def _assert_equal(built: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert built.keys() == expected.keys()
    for name, tensor in built.items():
        assert not tensor.is_meta, name
        assert torch.equal(tensor, expected[name]), name
        assert (split_of(tensor) is None) == (split_of(expected[name]) is None), name


class _Recording:
    """An open safetensors file whose reads add up, per tensor name, the elements read (into ``read``)."""

    def __init__(self, handle: Any, read: dict[str, int]) -> None:
        self.handle, self.read = handle, read

    def __enter__(self) -> _Recording:
        self.opened = self.handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> Any:
        return self.opened.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._count(name, self.opened.get_tensor(name))

    def get_slice(self, name: str) -> Any:
        view = self.opened.get_slice(name)
        recording = self

        class Slice:
            def get_shape(self) -> Any:
                return view.get_shape()

            def __getitem__(self, index: Any) -> torch.Tensor:
                return recording._count(name, view[index])

        return Slice()

    def _count(self, name: str, value: torch.Tensor) -> torch.Tensor:
        self.read[name] = self.read.get(name, 0) + value.numel()
        return value


def _recording(open_file: Any, read: dict[str, int], path: Path) -> _Recording:
    return _Recording(open_file(path), read)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_rank_reads_only_its_slice_of_each_split_tensor_from_the_pretrained_files(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = saved_model(tmp_path / kind, kind)
    spec = ModelSpec(kind="custom", entry=f"hf:{folder}", seq_len=8)
    index = 1  # a decoder block: every projection of it split
    whole = Weights(folder).shape_of
    read: dict[str, int] = {}
    monkeypatch.setattr(pretrained, "_open", functools.partial(_recording, pretrained._open, read))
    assert spec.custom.tp_plan  # the model described (and probed) before reads are counted
    for rank in range(SIZE):
        read.clear()
        expected = _whole_then_split(spec, index, rank)  # reads the layer whole
        assert read and all(read[n] == torch.Size(whole[n]).numel() for n in read)
        read.clear()
        built = _shard_built(spec, index, rank)
        _assert_equal(built, expected)
        split_names = [n for n, t in built.items() if split_of(t) is not None and n in read]
        assert len(split_names) >= 4, sorted(read)  # the attention's and the MLP's weights at least
        for name in read:
            numel = torch.Size(whole[name]).numel()
            assert read[name] == (numel // SIZE if name in split_names else numel), (rank, name)
        part = sum(t.numel() for t in built.values() if not t.is_meta)
        layer = sum(torch.Size(whole[n]).numel() for n in read)
        assert sum(read.values()) == part < layer  # what it read is its shard, less than the layer


@pytest.mark.parametrize("entry", ["hf:llama", "hf:gpt2"])
def test_each_ranks_initialised_shard_is_the_slice_of_the_whole_layer_the_seed_gives(entry: str) -> None:
    config = LLAMA if entry == "hf:llama" else GPT2
    spec = ModelSpec(kind="custom", entry=entry, hf_config=json.dumps(config), seq_len=8, seed=5)
    for index in (1, 2):
        for rank in range(SIZE):
            _assert_equal(_shard_built(spec, index, rank), _whole_then_split(spec, index, rank))


_MEMORY = """
import ctypes, functools, json, sys, torch
from pathlib import Path
from torch import nn
from pipeweave.models.custom import build_layer
from pipeweave.models.materialise import Cut, meta_parameters
from pipeweave.models.pipeline import pipeline
from pipeweave.runtime.stage.tensor_parallel import slice_of, split
from pipeweave.runtime.transport.mesh import MEASURING, TensorParallel

# Every tensor of 128 KiB or more mapped on allocation and unmapped on free (a fixed threshold: glibc's
# dynamic one would move freed tensors to the heap, whose holes count as resident): the peak resident set is
# then the bytes live at the peak, what the build itself holds.
ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
torch.set_num_threads(1)

def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

with meta_parameters():  # layer 0: four 2048 x 2048 linears, 67 MB in float32; its shard at N = 2: 33.6 MB
    net = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])
data = torch.utils.data.TensorDataset(torch.zeros(2, 2048), torch.zeros(2, 2048))
plan = {"0": "colwise", "1": "rowwise", "2": "colwise", "3": "rowwise"}
model = pipeline(net, None, ["4"], loss=nn.functional.mse_loss, dataset=data, tp_plan=plan)
tp = TensorParallel(MEASURING, 1, 2)
cut = Cut(lambda layer: split(layer, model.tp_plan[0], tp, "layer 0"), functools.partial(slice_of, rank=1))
base = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
layer = build_layer(model, 0, 0, cut if sys.argv[1] == "shard" else None)
if sys.argv[1] != "shard":
    layer = split(layer, model.tp_plan[0], tp, "layer 0")
print(json.dumps({"peak": status("VmHWM") - base, "part": sum(p.numel() * 4 for p in layer.parameters())}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak resident set reset")
def test_a_ranks_peak_while_building_its_shard_is_its_share_and_one_tensor_not_the_layer() -> None:
    tensor = 2048 * 2048 * 4  # one weight: 16.8 MB
    layer_bytes = 4 * (tensor + 2048 * 4)
    figures = {}
    for how in ("shard", "whole"):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(_MEMORY), how], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        figures[how] = json.loads(out.stdout.strip().splitlines()[-1])
    share = figures["shard"]["part"]
    assert share == figures["whole"]["part"] == 4 * tensor // 2 + 2 * 2048 * 4 // 2 + 2 * 2048 * 4
    # its shard, one module initialised whole at a time (its slice kept), and a fixed overhead
    assert figures["shard"]["peak"] < share + tensor + 8 * 2**20, figures  # measured: 53.9 MB
    assert figures["shard"]["peak"] < layer_bytes, figures
    assert figures["whole"]["peak"] > layer_bytes, figures  # the layer whole, then its shard beside it (87.4 MB)
