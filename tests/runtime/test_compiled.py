"""``--compile``: layers through torch.compile, the split backward (I, then W) kept, losses those of eager."""

from __future__ import annotations

import pytest
import torch
from config_defaults import train_config

from pipeweave.models import ModelSpec
from pipeweave.models.layers import Deferrable
from pipeweave.runtime.report.trace import summarize
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule import lower  # noqa: F401  (the registry's schedules)

SPEC = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8)


def _split_steps(compile: str | None) -> list[float]:
    """Two steps of one stage, each two microbatches through F, I and W (W after both I), then U: the
    losses and the gradients' sums."""
    worker = StageWorker(SPEC, range(SPEC.num_layers), batch_size=4, compile=compile)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, SPEC.vocab, (4, SPEC.seq_len), generator=g)
    y = torch.randint(0, SPEC.vocab, (4, SPEC.seq_len), generator=g)
    seen = []
    for _ in range(2):
        for j in range(2):
            seen.append(float(worker.forward(j, x[2 * j : 2 * j + 2], target=y[2 * j : 2 * j + 2])))
            worker.backward_input(j, None)
        grads_after_i = [p.grad for p in worker.named_parameters().values() if p.ndim == 2 and p.grad is not None]
        seen.append(float(len(grads_after_i)))  # the linear weights' gradients wait for W
        for j in range(2):
            worker.backward_weight(j)
        seen.append(float(sum(p.grad.abs().sum() for p in worker.named_parameters().values())))
        worker.update()
    return seen


def test_compiled_stage_keeps_the_split_backward_and_the_eager_numbers() -> None:
    """aot_eager (dynamo and AOTAutograd without code generation: seconds on a CPU) traces what inductor
    would; the deferrable linears stay eager, so I leaves their weight gradients to W exactly as eagerly."""
    eager = _split_steps(None)
    compiled = _split_steps("aot_eager")
    assert compiled == pytest.approx(eager, rel=1e-5)
    worker = StageWorker(SPEC, range(SPEC.num_layers), batch_size=4, compile="aot_eager")
    deferrable = [m for m in worker.module.modules() if isinstance(m, Deferrable)]
    assert deferrable and all(hasattr(m.forward, "_torchdynamo_disable") for m in deferrable)
    assert all(layer._compiled_call_impl is not None for layer in worker.module.values())
    assert list(worker.named_parameters()) == list(
        StageWorker(SPEC, range(SPEC.num_layers), batch_size=4).named_parameters()
    )


def _runs(context, configs):  # type: ignore[no-untyped-def]
    return [run_rank(context, prepare(config)) for config in configs]


@pytest.mark.slow  # inductor compiles every layer's forward and backward on each rank: about a minute on 2 cores
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_compile_trains_two_ranks_as_eager_and_reports_compile_time_apart() -> None:
    configs = [
        train_config(
            schedule="zb-h1", num_stages=2, num_microbatches=2, batch_size=4, steps=3, model=SPEC, compile=compiled
        )
        for compiled in (False, True)
    ]
    eager, compiled = launch(_runs, configs, 2, LaunchOptions(timeout_s=300))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    figures = summarize(prepare(configs[1]).schedule, compiled)
    assert figures["compile_s"] > 0 and "compile_s" not in summarize(prepare(configs[0]).schedule, eager)
    assert figures["step_time_s"] < figures["step_times_s"][0]  # the first step, where compilation ran, left out
