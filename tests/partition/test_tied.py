"""Tied embedding and head: their gradients are the untied sum, and the two copies stay bit-identical."""

from __future__ import annotations

import pytest
import torch
from config_defaults import train_config
from torch import nn

from pipeweave.data import ByteCorpus, split_microbatches
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec, build_layers, loss_fn
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.stage.tied import TiedGradients
from pipeweave.runtime.walk import build_workers, run_step
from pipeweave.schedule import SCHEDULES, generate

TEXT = b"a tied embedding and head share one matrix; " * 30
SPEC = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8, tie_embeddings=True)
HEAD = f"{SPEC.num_layers - 1}.out.weight"


def shared_parameter_training(spec: ModelSpec, steps: int, batch: int, microbatches: int) -> list[float]:
    """The oracle: one model whose head *is* the embedding's parameter, trained with SGD lr 0.1."""
    layers = build_layers(spec, range(spec.num_layers))
    layers[-1].out.weight = layers[0].token  # one Parameter: autograd sums both uses
    model = nn.ModuleList(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data, loss = ByteCorpus(TEXT, seq_len=spec.seq_len, batch_size=batch), loss_fn(spec)
    losses = []
    for step in range(steps):
        inputs, targets = data.batch(step)
        total = 0.0
        for x, y in zip(split_microbatches(inputs, microbatches), split_microbatches(targets, microbatches)):
            for layer in model:
                x = layer(x)
            part = loss(x, y) * (len(y) / batch)
            part.backward()
            total += part.item()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def test_tied_copies_start_equal_and_only_for_the_transformers() -> None:
    first, last = build_layers(SPEC, [0])[0], build_layers(SPEC, [SPEC.num_layers - 1])[0]
    assert torch.equal(first.token, last.out.weight)
    with pytest.raises(UserError, match="applies to the gpt and the llama"):
        ModelSpec(kind="mlp", tie_embeddings=True)


def test_gradients_are_the_untied_sum() -> None:
    schedule = generate("1f1b", num_stages=2, num_microbatches=2)
    workers = build_workers(schedule, SPEC, batch_size=6)
    ties = TiedGradients(schedule.placement, dict(enumerate(workers)))
    seen: dict[str, torch.Tensor] = {}
    for stage, name in [(0, "0.token"), (1, HEAD)]:
        param = workers[stage].named_parameters()[name]
        step = workers[stage].optimizer.step
        workers[stage].optimizer.step = lambda step=step, param=param, name=name: (  # type: ignore[method-assign]
            seen.setdefault(name, param.grad.clone()),
            step(),
        )[1]
    inputs, targets = ByteCorpus(TEXT, seq_len=8, batch_size=6).batch(0)
    run_step(schedule, workers, split_microbatches(inputs, 2), split_microbatches(targets, 2), combine=ties.hooks)
    # untied gradients of the same batch, from one whole untied model
    untied = build_layers(SPEC, range(SPEC.num_layers))
    x = inputs
    for layer in untied:
        x = layer(x)
    loss_fn(SPEC)(x, targets).backward()
    expected = untied[0].token.grad + untied[-1].out.weight.grad
    assert torch.equal(seen["0.token"], seen[HEAD])
    torch.testing.assert_close(seen["0.token"], expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(untied[0].token.grad, expected)  # the head's share is not negligible


@pytest.mark.parametrize("name", [n for n in ("1f1b", "zb-h1") if n in SCHEDULES])
def test_reference_run_equals_one_shared_parameter_and_stays_bit_identical(name: str) -> None:
    schedule = generate(name, num_stages=2, num_microbatches=3)
    result = run_reference(schedule, SPEC, steps=3, batch_size=6, data=ByteCorpus(TEXT, seq_len=8, batch_size=6))
    assert result.losses == pytest.approx(shared_parameter_training(SPEC, 3, 6, 3), rel=1e-5)
    first, last = result.stage_parameters[0], result.stage_parameters[-1]
    assert torch.equal(first["0.token"], last[HEAD])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_distributed_tied_weights_stay_bit_identical(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "text.txt"
    data.write_bytes(TEXT)
    config = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=3,
        model=SPEC,
        batch_size=6,
        steps=3,
        lr=0.1,
        data=str(data),
        collect_parameters=True,
        layers_per_part=(1, 3),
    )
    record = launch(run_rank, prepare(config), 2, LaunchOptions(timeout_s=60))
    rank0, rank1 = (r.parameters for r in record.ranks)
    assert torch.equal(rank0[0]["0.token"], rank1[1][HEAD])
    assert record.losses == pytest.approx(shared_parameter_training(SPEC, 3, 6, 3), rel=1e-5)
