"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pipeweave.models.build import build_layers
from pipeweave.models.spec import loss_fn
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.prepare import build_schedule, layer_ranges, optimizer_factory


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """In-process runs on one intra-op thread.

    Tiny models: threads only add contention (8x CPU time on a loaded 2-core
    machine); and the distributed ranks run one thread each, so an in-process
    oracle on one thread reduces in the same order (AdamW normalises the
    rounding noise of a gradient that is ~0, such as an attention key bias's,
    to steps of lr's size).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def equals_reference() -> Callable[[Any, Any], None]:
    """``equals_reference(config, record)``: a run's losses and every stage's final parameters are the
    reference executor's on the same schedule (rtol 1e-5, atol 1e-6)."""

    def check(config: Any, record: Any) -> None:
        schedule = build_schedule(config)
        reference = run_reference(
            schedule,
            config.model,
            steps=config.steps,
            batch_size=config.batch_size,
            optimizer_factory=optimizer_factory(config),
            parts=layer_ranges(config, schedule),  # the run's split (uniform, or --layers-per-stage's)
        )
        torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6)
        for rank_record in record.ranks:
            for stage, params in rank_record.parameters.items():
                for name, value in params.items():
                    torch.testing.assert_close(value, reference.stage_parameters[stage][name], rtol=1e-5, atol=1e-6)

    return check


@pytest.fixture
def checkpoint_tensors(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], dict[str, torch.Tensor]]:
    """Reads every key of a checkpoint folder (``parameters/0.up.weight``, ...) with DCP's own converter, which
    writes them into one torch.save file, loaded here with ``weights_only``."""

    def read(folder: Path) -> dict[str, torch.Tensor]:
        whole = tmp_path_factory.mktemp("whole") / "whole.pt"
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp_to_torch_save(folder, whole)
        return dict(torch.load(whole, weights_only=True))

    return read


@pytest.fixture
def held_out_loss() -> Callable[[Any, dict[str, torch.Tensor], Any, int], float]:
    """``held_out_loss(spec, parameters, source, batches)``: the mean loss of the model with ``parameters`` (by
    global name), whole in one process in eval mode, over ``source``'s first ``batches`` held-out batches."""

    def loss(spec: Any, parameters: dict[str, torch.Tensor], source: Any, batches: int) -> float:
        model = nn.ModuleDict({str(i): layer for i, layer in enumerate(build_layers(spec, range(spec.num_layers)))})
        model.load_state_dict(parameters)
        model.eval()
        losses = []
        with torch.no_grad():
            for k in range(batches):
                x, y = source.eval_batch(k)
                for layer in model.values():
                    x = layer(x)
                losses.append(float(loss_fn(spec)(x, y)))
        return sum(losses) / len(losses)

    return loss
