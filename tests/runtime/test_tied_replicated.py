"""Tied embeddings under replicated parts (Chimera, GEMS, DualPipe): the reference equals its 1F1B and one shared parameter.

Regression: the reference executor combined a part's replicas at the part's
first ``U`` only, so the first tied exchange read the peer part's gradient of
one replica (the other half of the microbatches missing) and a later replica
sum added the embedding's gradient twice; chimera drifted from 1F1B at step 2
(5.5189 vs 5.5155 on the 4-layer gpt below) and the two replicas of part 0
ended with different embeddings.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeweave.data import data_source, split_microbatches
from pipeweave.models import ModelSpec, build_layers, loss_fn
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.stage.worker import sgd
from pipeweave.schedule import generate

SPEC = ModelSpec(kind="gpt", layers=4, hidden=16, heads=2, seq_len=8, tie_embeddings=True)
STEPS = 2  # the bug showed from the second step on (its loss reads the first update)
EMBEDDING, HEAD = "0.token", f"{SPEC.num_layers - 1}.out.weight"


def batch_size(num_microbatches: int) -> int:
    return 2 * num_microbatches - 1  # the last microbatch is smaller than the others


def one_shared_parameter(num_microbatches: int) -> tuple[list[float], torch.Tensor]:
    """Plain accumulation on the whole model whose head IS the embedding (autograd sums both uses)."""
    layers = build_layers(SPEC, range(SPEC.num_layers))
    layers[-1].out.weight = layers[0].token
    model = nn.Sequential(*layers)
    optimizer = sgd()(list(model.parameters()))  # the reference's default optimizer
    batch = batch_size(num_microbatches)
    source, loss = data_source(SPEC, batch_size=batch), loss_fn(SPEC)
    losses = []
    for step in range(STEPS):
        inputs, targets = source.batch(step)
        parts = [
            loss(model(x), y) * (len(y) / batch)
            for x, y in zip(split_microbatches(inputs, num_microbatches), split_microbatches(targets, num_microbatches))
        ]
        sum(parts).backward()  # type: ignore[union-attr]
        losses.append(sum(p.item() for p in parts))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, layers[0].token.detach().clone()


@pytest.mark.parametrize(
    ("name", "stages", "microbatches"),
    [("chimera", 2, 4), ("chimera", 4, 8), ("gems", 2, 4), ("dualpipe", 2, 4)],
)
def test_replicated_tied_reference_equals_1f1b_and_one_shared_parameter(
    name: str, stages: int, microbatches: int
) -> None:
    batch = batch_size(microbatches)
    replicated = run_reference(
        generate(name, num_stages=stages, num_microbatches=microbatches), SPEC, steps=STEPS, batch_size=batch
    )
    straight = run_reference(
        generate("1f1b", num_stages=stages, num_microbatches=microbatches), SPEC, steps=STEPS, batch_size=batch
    )
    losses, shared = one_shared_parameter(microbatches)
    assert replicated.losses == pytest.approx(straight.losses, rel=1e-5)
    assert replicated.losses == pytest.approx(losses, rel=1e-5)
    # Every copy of the tied matrix (both ends, both replicas of each end) is bitwise one tensor ...
    copies = [p[k] for p in replicated.stage_parameters for k in (EMBEDDING, HEAD) if k in p]
    assert len(copies) == 4
    assert all(torch.equal(copies[0], c) for c in copies[1:])
    # ... and it is the shared parameter's value.
    torch.testing.assert_close(copies[0], shared, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(copies[0], straight.parameters[EMBEDDING], rtol=1e-5, atol=1e-6)
