"""Your own model (``--model FILE.py:NAME``): trained exactly like the reference models.

``tests/models/tiny_custom.py`` is a model pipeweave knows nothing of: integer
inputs into ``nn.Embedding``, residual blocks with ``nn.LayerNorm``,
``nn.Conv1d`` and ``nn.Linear`` inside ``nn.Sequential``, a pooling head,
cross-entropy. On 2 gloo ranks, synchronous schedules (split backward,
recomputation, chunks, replicated parts) equal plain training of the same
layers; an asynchronous stream equals its one-process reference; the
held-out loss is the final weights' loss in ``eval()`` mode; a checkpoint
resumes on another schedule. Then the contract's pieces one by one, and bad
entries as one line each.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from config_defaults import train_config
from torch import nn

from pipeweave.config import TrainConfig
from pipeweave.data import DatasetSource, data_source
from pipeweave.errors import UserError
from pipeweave.models import LayerModel, ModelSpec, build_layers
from pipeweave.models.custom import deferrable, entry_of, load_model
from pipeweave.models.layers import Linear
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.stage.worker import StageWorker

FILE = Path(__file__).resolve().parent.parent / "models" / "tiny_custom.py"
SPEC = ModelSpec(kind="custom", entry=f"{FILE}:model")
STEPS = 3
BASE = dict(num_stages=2, num_microbatches=4, model=SPEC, batch_size=14, steps=STEPS, collect_parameters=True)

CASES = {
    "1f1b": train_config(schedule="1f1b", **BASE),  # type: ignore[arg-type]
    "zb-h1": train_config(schedule="zb-h1", **BASE),  # type: ignore[arg-type]
    "zb-h1+recompute": train_config(schedule="zb-h1", recompute=True, **BASE),  # type: ignore[arg-type]
    "interleaved-1f1b": train_config(schedule="interleaved-1f1b", num_chunks=2, **BASE),  # type: ignore[arg-type]
    "zb-v": train_config(schedule="zb-v", **{**BASE, "num_microbatches": 4}),  # type: ignore[arg-type]
    "chimera": train_config(schedule="chimera", **BASE),  # type: ignore[arg-type]
    "1f1b adamw eval": train_config(schedule="1f1b", optimizer="adamw", lr=1e-2, eval_every=2, eval_batches=2, **BASE),  # type: ignore[arg-type]
    "pipedream": train_config(schedule="pipedream", **{**BASE, "steps": 6}),  # type: ignore[arg-type]
}


def _variants(label: str, base: dict[str, Any], *, stream: bool = False) -> dict[str, TrainConfig]:
    """Split backward with recomputation, chunks and replicated parts (and a stream) on another model."""
    cases = {
        f"{label} 1f1b": train_config(schedule="1f1b", **base),
        f"{label} zb-h1+recompute": train_config(schedule="zb-h1", recompute=True, **base),
        f"{label} interleaved-1f1b": train_config(schedule="interleaved-1f1b", num_chunks=2, **base),
        f"{label} chimera": train_config(schedule="chimera", **base),
    }
    if stream:
        cases[f"{label} pipedream"] = train_config(schedule="pipedream", **{**base, "steps": 6})
    return cases


# With dropout and batch norm (``tiny_custom.noisy``): masks keyed by (step, microbatch, layer).
NOISY = ModelSpec(kind="custom", entry=f"{FILE}:noisy")
NOISY_BASE = {**BASE, "model": NOISY}
# Tuples between layers (``tiny_custom.tuples``): (hidden, mask), (hidden, gate, mask) cross the boundaries.
TUPLES = ModelSpec(kind="custom", entry=f"{FILE}:tuples")
TUPLES_BASE = {**BASE, "model": TUPLES}
CASES.update(_variants("noisy", NOISY_BASE))
CASES.update(_variants("tuples", TUPLES_BASE, stream=True))
STREAMS = ("pipedream", "tuples pipedream")


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[TrainConfig, RunRecord]]:
    for config in CASES.values():
        prepare(config)
    records = launch(_run_all, list(CASES.values()), 2, LaunchOptions(timeout_s=60))
    return {name: (config, record) for (name, config), record in zip(CASES.items(), records)}


def _plain(config: TrainConfig):  # type: ignore[no-untyped-def]
    return run_plain(
        config.model,
        steps=config.steps,
        batch_size=config.batch_size,
        num_microbatches=config.num_microbatches,
        optimizer_factory=optimizer_factory(config),
    )


def _parameters(record: RunRecord) -> dict[str, torch.Tensor]:
    return {name: value for r in record.ranks for params in r.parameters.values() for name, value in params.items()}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [c for c in CASES if c not in STREAMS])
def test_synchronous_schedules_equal_plain_training(runs: dict[str, tuple[TrainConfig, RunRecord]], case: str) -> None:
    config, record = runs[case]
    plain = _plain(config)
    torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
    params = _parameters(record)
    assert set(params) == set(plain.parameters)
    for name, value in params.items():
        torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6)
    layers = build_layers(config.model, range(config.model.num_layers))
    initial = dict(nn.ModuleDict({str(i): m for i, m in enumerate(layers)}).named_parameters())
    moved = [name for name, value in params.items() if not torch.equal(value, initial[name])]
    assert len(moved) == len(params)  # every parameter was trained, the Linears' (deferred) among them


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", STREAMS)
def test_a_stream_equals_its_reference(
    runs: dict[str, tuple[TrainConfig, RunRecord]], case: str, equals_reference: Any
) -> None:
    equals_reference(*runs[case])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_held_out_loss_is_the_final_weights_loss_in_eval_mode(
    runs: dict[str, tuple[TrainConfig, RunRecord]], held_out_loss: Any
) -> None:
    config, record = runs["1f1b adamw eval"]
    source = data_source(SPEC, batch_size=config.batch_size)
    assert [at for at, _ in record.eval_losses] == [2, 3]
    assert record.eval_losses[-1][1] == pytest.approx(
        held_out_loss(SPEC, _parameters(record), source, config.eval_batches), rel=1e-5
    )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_checkpoint_resumes_on_another_schedule(tmp_path: Path) -> None:
    # The model with dropout: the resumed run draws the masks of steps 2.. (the key counts steps).
    first = train_config(
        schedule="1f1b",
        **{**NOISY_BASE, "steps": 2, "collect_parameters": False},  # type: ignore[arg-type]
        optimizer="adamw",
        lr=1e-2,
        save=str(tmp_path / "ckpt"),
    )
    launch(run_rank, prepare(first), 2, LaunchOptions(timeout_s=60))
    second = train_config(
        schedule="zb-h1",
        **{**NOISY_BASE, "steps": 3},
        optimizer="adamw",  # type: ignore[arg-type]
        lr=1e-2,
        resume=str(tmp_path / "ckpt"),
    )
    prepare(second)
    resumed = launch(run_rank, prepare(second), 2, LaunchOptions(timeout_s=60))
    plain = _plain(dataclasses.replace(second, steps=5))
    torch.testing.assert_close(resumed.losses, plain.losses[2:], rtol=1e-5, atol=1e-6)
    for name, value in _parameters(resumed).items():
        torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6)
    other = ModelSpec(kind="custom", entry=f"{FILE}:shallow")
    with pytest.raises(UserError, match="holds another model: entry="):
        prepare(dataclasses.replace(second, model=other))


def test_linear_layers_are_swapped_on_their_parameters_and_their_weight_gradients_deferred() -> None:
    worker = StageWorker(SPEC, range(0, 3), batch_size=4)
    linears = [m for m in worker.module.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 and not any(type(m) is nn.Linear for m in worker.module.modules())
    x, _ = data_source(SPEC, batch_size=4).batch(0)
    out = worker.forward(0, x)
    worker.backward_input(0, torch.ones_like(out))
    assert all(m.weight.grad is None for m in linears)  # deferred to W
    conv = worker.module["1"].mix.weight
    assert conv.grad is not None  # autograd's, at once
    worker.backward_weight(0)
    deferred = {name: p.grad.clone() for name, p in worker.named_parameters().items()}
    worker.optimizer.zero_grad(set_to_none=True)
    worker.forward(1, x)
    worker.backward(1, torch.ones_like(out))  # B computes the same gradients at once
    for name, p in worker.named_parameters().items():
        assert torch.equal(p.grad, deferred[name]), name


def test_a_layer_is_the_same_on_any_rank_and_differs_from_its_neighbours() -> None:
    a = build_layers(SPEC, [2])[0]
    b = build_layers(SPEC, range(SPEC.num_layers))[2]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = build_layers(SPEC, [3])[0]
    assert not torch.equal(a.norm.weight + a.mix.weight.sum(), c.norm.weight + c.mix.weight.sum())
    reseeded = build_layers(dataclasses.replace(SPEC, seed=1), [2])[0]
    assert not torch.equal(a.mix.weight, reseeded.mix.weight)
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    build_layers(SPEC, [2])
    assert torch.equal(torch.rand(1), before)  # the user's global RNG state is left alone


def test_deferrable_keeps_the_parameter_objects_and_leaves_subclasses() -> None:
    linear = nn.Linear(3, 2)
    attention = nn.MultiheadAttention(4, 2)  # out_proj: a subclass its owner uses by its parameters
    seq = deferrable(nn.Sequential(linear, nn.ReLU(), attention))
    assert seq[0].weight is linear.weight and seq[0].bias is linear.bias
    assert type(seq[2].out_proj) is not Linear
    assert isinstance(deferrable(nn.Linear(2, 2, bias=False)), Linear)


def test_batches_follow_seeded_epoch_permutations() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10), torch.arange(10) * 3)
    source = DatasetSource(data, batch_size=4, seed=7)
    drawn = torch.cat([source.batch(k)[0] for k in range(5)])  # 20 samples: two epochs
    assert sorted(drawn[:10].tolist()) == list(range(10)) and sorted(drawn[10:].tolist()) == list(range(10))
    assert not torch.equal(drawn[:10], drawn[10:])  # each epoch its own order
    assert torch.equal(DatasetSource(data, batch_size=4, seed=7).batch(3)[0], source.batch(3)[0])
    assert not torch.equal(DatasetSource(data, batch_size=4, seed=8).batch(0)[0], source.batch(0)[0])
    x, y = source.batch(2)
    assert torch.equal(y, x * 3)
    tiny = DatasetSource(torch.utils.data.TensorDataset(torch.arange(3), torch.arange(3)), batch_size=7)
    assert len(tiny.batch(0)[0]) == 7
    with pytest.raises(UserError, match="no eval_dataset"):
        source.eval_batch(0)


def test_model_spec_of_a_module_level_function() -> None:
    module = load_model(f"{FILE}:model")  # loads the file as a module of its own
    assert isinstance(module, LayerModel)
    factory = sys.modules[type(module.layers[1]()).__module__].model
    spec = ModelSpec.of(factory, seed=3)
    assert spec.entry == f"{FILE}:model" and spec.seed == 3 and spec.num_layers == 6
    with pytest.raises(UserError, match="not a module-level function"):
        entry_of(lambda: module)


@pytest.mark.parametrize(
    "entry, message",
    [
        ("no_colon", "unknown"),
        ("missing_file.py:model", "no file missing_file.py"),
        ("no_such_module_xyz:model", "cannot import no_such_module_xyz"),
        ("{FILE}:absent", "has no 'absent'"),
        ("{FILE}:not_a_model", "gives int, not a pipeweave.models.LayerModel"),
        (
            "{FILE}:returns_tuple",
            "layer 0 of the model returns tuple; each layer must return a tensor or a tuple of tensors",
        ),  # LSTM: (output, (h, c))
        ("{FILE}:returns_list", "layer 0 of the model returns list; each layer must return a tensor or a tuple"),
        ("{FILE}:wide_tuple", "layer 0 of the model returns a tuple of 9 tensors; a stage boundary carries at most 8"),
        ("{FILE}:raises", r"raises\(\) raised RuntimeError: no data here \(.*tiny_custom.py:\d+\)"),
        ("{FILE}:wrong_width", "layer 1 of the model fails on the output of layer 0: RuntimeError"),
        ("{FILE}:wrong_targets", "the model's loss fails on the last layer's output and the targets"),
        ("{FILE}:batch_second", r"layer 1 of the model returns shape \(8, 2, 24\) for 2 samples; keep the samples"),
        ("{SYNTAX}:model", r"loading .*broken.py raised SyntaxError: .* \(.*broken.py:2\)"),
    ],
)
@pytest.mark.filterwarnings("ignore:Using a target size")  # mse_loss's own warning before it fails
def test_bad_entries_are_one_line_before_anything_is_spawned(tmp_path: Path, entry: str, message: str) -> None:
    (tmp_path / "broken.py").write_text("def model():\n    return (\n")
    entry = entry.replace("{FILE}", str(FILE)).replace("{SYNTAX}", str(tmp_path / "broken.py"))
    from pipeweave.cli import build_parser
    from pipeweave.commands.train_run import build_config

    with pytest.raises(UserError, match=message):
        prepare(build_config(build_parser().parse_args(["train", "--model", entry])))


def test_size_options_and_bad_contracts_are_refused() -> None:
    from pipeweave.cli import build_parser
    from pipeweave.commands.train_run import build_config

    with pytest.raises(UserError, match="--hidden applies to the built-in models"):
        build_config(build_parser().parse_args(["train", "--model", f"{FILE}:model", "--hidden", "8"]))
    with pytest.raises(UserError, match="not a function"):
        LayerModel(layers=[nn.Linear(2, 2)], loss=nn.functional.mse_loss, dataset=[(torch.ones(2), torch.ones(2))])
    with pytest.raises(UserError, match="map-style dataset"):
        LayerModel(layers=[lambda: nn.Linear(2, 2)], loss=nn.functional.mse_loss, dataset=iter([]))
    with pytest.raises(UserError, match="needs its entry"):
        ModelSpec(kind="custom")
    mlp_eval = train_config(model=ModelSpec(kind="mlp", layers=2, hidden=4), eval_every=1)
    with pytest.raises(UserError, match="--eval-every applies to --model gpt, llama or a custom model"):
        prepare(mlp_eval)


def test_train_cli_trains_a_model_file(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeweave.cli",
            "train",
            "--model",
            f"{FILE}:model",
            "-s",
            "zb-h1",
            "--batch",
            "8",
            "--microbatches",
            "4",
            "--steps",
            "3",
            "--quiet",
            "--json",
            str(out),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["model"]["entry"] == f"{FILE}:model" and len(record["losses"]) == 3
    assert record["optimizer"] == "adamw"


@pytest.mark.parametrize(
    "name",
    [
        "pipeweave.models.custom",
        "pipeweave.models.randomness",
        "pipeweave.data.dataset",
        "pipeweave.runtime.transport.message",
        "pipeweave.models.precision",
        "pipeweave.runtime.stream",
        "pipeweave.config.train",
        "pipeweave.runtime.run.streams",
    ],
)
def test_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_only_ranks_with_a_first_or_last_stage_draw_batches() -> None:
    from pipeweave.runtime.run.milestones import rank_microbatches

    drawn: list[int] = []

    class Counting:
        def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            drawn.append(k)
            return data_source(SPEC, batch_size=8).batch(k)

    middle = {1: StageWorker(SPEC, range(2, 4), batch_size=8)}
    assert rank_microbatches(Counting(), 0, 4, torch.device("cpu"), middle) == ([], [])
    assert drawn == []  # a middle rank loads nothing from a user's (maybe costly) dataset
    last = {2: StageWorker(SPEC, range(4, 6), batch_size=8)}
    inputs, targets = rank_microbatches(Counting(), 5, 4, torch.device("cpu"), last)
    assert drawn == [5] and [len(t) for t in targets] == [2, 2, 2, 2]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_checkpoint_keeps_the_buffers(
    tmp_path: Path, checkpoint_tensors: Callable[[Path], dict[str, torch.Tensor]]
) -> None:
    from pipeweave.runtime.run import checkpoint, checkpoint_files

    spec = ModelSpec(kind="custom", entry=f"{FILE}:with_buffer")
    first = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        model=spec,
        batch_size=8,
        steps=2,
        save=str(tmp_path / "ckpt"),
    )
    launch(run_rank, prepare(first), 2, LaunchOptions(timeout_s=60))
    found = checkpoint_files.find(str(tmp_path / "ckpt"))
    saved = {
        key.removeprefix("buffers/"): v
        for key, v in checkpoint_tensors(found.folder).items()
        if key.startswith("buffers/")
    }
    assert set(saved) == {"1.peak"} and float(saved["1.peak"]) > 0  # trained, not the initial zero
    worker = StageWorker(spec, range(0, 3), batch_size=8)  # resumed on one stage holding every layer
    assert float(worker.module["1"].peak) == 0
    checkpoint.load(found.folder, found.manifest, {0: worker})
    assert torch.equal(worker.module["1"].peak, saved["1.peak"])


def _noisy_stage(**options: Any) -> StageWorker:
    return StageWorker(NOISY, range(0, 2), batch_size=8, **options)


def test_dropout_masks_are_keyed_by_step_microbatch_and_layer() -> None:
    tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    a, b = _noisy_stage(), _noisy_stage()
    first = a.forward(0, tokens)
    torch.testing.assert_close(b.forward(0, tokens), first, rtol=0, atol=0)  # same key, same masks
    assert not torch.equal(a.forward(1, tokens), first)  # another microbatch, other masks
    grad = torch.ones_like(first)
    a.backward(0, grad)
    a.backward(1, grad)
    a.update()
    assert a.steps_done == 1
    b.module.load_state_dict(a.module.state_dict())
    b.backward(0, grad)
    again = b.forward(0, tokens)
    assert not torch.equal(a.forward(0, tokens), again)  # another step, other masks


def test_a_keyed_forward_leaves_the_callers_random_stream_alone() -> None:
    tokens = torch.randint(0, 16, (4, 8))
    worker = _noisy_stage()
    torch.manual_seed(7)
    expected = torch.rand(5)
    torch.manual_seed(7)
    worker.forward(0, tokens)
    torch.testing.assert_close(torch.rand(5), expected, rtol=0, atol=0)


def test_a_replayed_forward_draws_its_first_masks_and_leaves_the_running_statistics() -> None:
    tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
    grad = torch.randn(4, 8, 24, generator=torch.Generator().manual_seed(2))
    kept, replayed = _noisy_stage(), _noisy_stage(recompute=True)
    for worker in (kept, replayed):
        for mb in range(2):
            worker.forward(mb, tokens)
            worker.backward(mb, grad)
    for (name, x), (_, y) in zip(kept.module.named_buffers(), replayed.module.named_buffers()):
        torch.testing.assert_close(y, x, rtol=0, atol=0, msg=name)
    assert int(dict(kept.module.named_buffers())["1.norm.num_batches_tracked"]) == 2
    for (name, x), (_, y) in zip(kept.module.named_parameters(), replayed.module.named_parameters()):
        torch.testing.assert_close(y.grad, x.grad, rtol=0, atol=0, msg=name)


def test_data_parallel_replicas_draw_the_masks_of_plain_training() -> None:
    from pipeweave.schedule import generate
    from pipeweave.schedule.data_parallel import data_parallel

    grid = data_parallel(generate("1f1b", num_stages=2, num_microbatches=2), 2)
    reference = run_reference(grid, NOISY, steps=2, batch_size=12)
    plain = run_plain(NOISY, steps=2, batch_size=12, num_microbatches=4)
    torch.testing.assert_close(reference.losses, plain.losses, rtol=1e-5, atol=1e-6)
    for name, value in plain.parameters.items():
        torch.testing.assert_close(reference.parameters[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tuples_cross_three_ranks_over_shared_memory() -> None:
    config = train_config(schedule="zb-h1", **{**TUPLES_BASE, "num_stages": 3, "num_microbatches": 5})  # type: ignore[arg-type]
    prepare(config)
    record = launch(run_rank, prepare(config), 3, LaunchOptions(transport="shm", timeout_s=60))
    assert record.transport == "shm"
    plain = _plain(config)
    torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
    for name, value in _parameters(record).items():
        torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6)


def test_a_tuples_gradient_has_one_tensor_per_floating_point_input_zeros_where_unused() -> None:
    worker = StageWorker(TUPLES, range(3, 4), batch_size=4)  # Join: (hidden, gate, mask) -> (hidden, mask)
    h, gate = torch.randn(4, 8, 24), torch.rand(4, 8, 24)
    mask = torch.zeros(4, 8, dtype=torch.bool)  # nothing kept: the gate gets a zero gradient
    out = worker.forward(0, (h, gate, mask))
    assert isinstance(out, tuple) and [t.dtype for t in out] == [torch.float32, torch.bool]
    grad_h, grad_gate = worker.backward(0, (torch.ones(4, 8, 24),))
    torch.testing.assert_close(grad_h, torch.ones(4, 8, 24))
    torch.testing.assert_close(grad_gate, torch.zeros(4, 8, 24))
    with pytest.raises(RuntimeError, match="2 gradients for a stage output with 1 floating-point tensors"):
        worker.forward(1, (h, gate, mask))
        worker.backward(1, (torch.ones(4, 8, 24), torch.ones(4, 8, 24)))


def test_the_profiler_takes_tuples(tmp_path: Path) -> None:
    from pipeweave.runtime.profile import profile_model

    costs = profile_model(TUPLES, 4, repeats=1, warmup=0, cache_dir=tmp_path)
    assert costs.num_layers == 6 and all(t > 0 for t in costs.forward)
    assert costs.output[2] > costs.output[1]  # Fork's output holds the gate beside the hidden states


def test_a_tuple_message_packs_mixed_dtypes_each_aligned() -> None:
    from pipeweave.runtime.transport.message import Layout, read_meta

    parts = (torch.rand(3, 5) > 0.5, torch.randn(3, 2, dtype=torch.float64), torch.arange(3, dtype=torch.int16))
    layout = Layout.of(parts)
    assert layout.spans(3) == [(0, 15), (16, 48), (64, 6)] and layout.nbytes(3) == 70
    back = layout.unpack(layout.pack(parts, 3), 3)
    for sent, received in zip(parts, back):
        assert received.dtype == sent.dtype and torch.equal(received, sent)
    assert read_meta(layout.encode().tolist()) == layout


def test_a_stage_of_activations_only_runs_its_actions_and_updates_nothing() -> None:
    # A split nn.Sequential has its activations as layers of their own: a stage may hold only those
    # (5 stages over tied_sequential's 5 children), and torch's optimizers refuse an empty parameter list.
    spec = ModelSpec(kind="custom", entry=f"{FILE.parent / 'tiny_modules.py'}:tied_sequential")
    worker = StageWorker(
        spec,
        range(1, 2),
        batch_size=4,
        optimizer_factory=optimizer_factory(
            train_config(schedule="1f1b", num_stages=5, num_microbatches=1, model=spec, batch_size=4, optimizer="adamw")
        ),
    )
    assert not list(worker.module.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    out = worker.forward(0, x)
    assert torch.equal(out, torch.tanh(x))
    assert torch.allclose(worker.backward(0, torch.ones_like(out)), 1 - torch.tanh(x) ** 2)
    worker.update()
    assert worker.optimizer.state_dict()["state"] == {}
