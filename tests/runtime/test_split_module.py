"""Modules as written, split by ``pipeweave.pipeline``: every schedule equals training the unsplit module.

On 2 gloo ranks: a transformer whose forward loops over its blocks, with its
head tied to its embedding (one Parameter in the module, copies on the first
and last stage whose gradients are summed), cut automatically before every
block; an ``nn.Sequential`` without split points; a module cut into 2 parts
balanced by the profiler (``split_points=2``); (slow) a mixture of experts
that ``torch.export`` refuses, traced by ``torch.fx`` with its blocks whole;
the looped transformer, and (slow) GPT-2, on batches whose microbatches have
sequence lengths of their own (``min_seq_len``: the sequence dimension is
traced as dynamic, masks and positions recomputed per part follow it); and (slow) tiny Hugging
Face GPT-2 and Llama models with tied embeddings. 1f1b, zb-h1 and
interleaved-1f1b give the losses and final weights of plain training of the
unsplit module -- the module itself, trained by a loop of torch code here, not
pipeweave's layers; an asynchronous stream (pipedream) equals its reference (tied models on
pipedream-2bw: test_tied_stream.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.record import RunRecord

MODELS = Path(__file__).resolve().parent.parent / "models"
sys.path.insert(0, str(MODELS))
from unsplit import train_unsplit  # noqa: E402

FILE = MODELS / "tiny_modules.py"
LOOPED = ModelSpec(kind="custom", entry=f"{FILE}:looped")
SEQUENTIAL = ModelSpec(kind="custom", entry=f"{FILE}:sequential")
UNEVEN = ModelSpec(kind="custom", entry=f"{FILE}:uneven")  # split_points=2: cut where the profiler balances
ROUTED = ModelSpec(kind="custom", entry=f"{FILE}:routed")  # traced by torch.fx, its blocks kept whole
GPT2 = json.dumps(
    {
        "n_layer": 3,
        "n_embd": 32,
        "n_head": 2,
        "vocab_size": 256,
        "n_positions": 32,
        "resid_pdrop": 0,
        "embd_pdrop": 0,
        "attn_pdrop": 0,
    }
)
LLAMA = json.dumps(
    {
        "num_hidden_layers": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 256,
        "max_position_embeddings": 32,
        "tie_word_embeddings": True,
    }
)
HF = {
    "gpt2": ModelSpec(kind="custom", entry="hf:gpt2", hf_config=GPT2, seq_len=16),
    "llama": ModelSpec(kind="custom", entry="hf:llama", hf_config=LLAMA, seq_len=16),
}
STEPS = 3


def _cases(label: str, spec: ModelSpec) -> dict[str, TrainConfig]:
    base: dict[str, Any] = dict(
        num_stages=2, num_microbatches=4, model=spec, batch_size=8, steps=STEPS, collect_parameters=True
    )
    return {
        f"{label} 1f1b": train_config(schedule="1f1b", **base),
        f"{label} zb-h1": train_config(schedule="zb-h1", **base),
        f"{label} interleaved-1f1b": train_config(schedule="interleaved-1f1b", num_chunks=2, **base),
    }


LOOPED_CASES = _cases("looped", LOOPED)
FAST = {name: LOOPED_CASES[name] for name in ("looped 1f1b", "looped zb-h1")}
FAST.update(
    {
        "sequential 1f1b": train_config(
            schedule="1f1b",
            num_stages=2,
            num_microbatches=4,
            model=SEQUENTIAL,
            batch_size=8,
            steps=STEPS,
            collect_parameters=True,
        ),
        "uneven 1f1b": train_config(
            schedule="1f1b",
            num_stages=2,
            num_microbatches=4,
            model=UNEVEN,
            batch_size=8,
            steps=STEPS,
            collect_parameters=True,
        ),
        "looped 1f1b variable lengths": train_config(
            schedule="1f1b",
            num_stages=2,
            num_microbatches=4,
            model=LOOPED,
            batch_size=8,
            steps=STEPS,
            collect_parameters=True,
            min_seq_len=3,
        ),
        "sequential pipedream": train_config(
            schedule="pipedream",
            num_stages=2,
            num_microbatches=4,
            model=SEQUENTIAL,
            batch_size=8,
            steps=6,
            collect_parameters=True,
        ),
    }
)
SLOW = {
    "looped interleaved-1f1b": LOOPED_CASES["looped interleaved-1f1b"],
    **_cases("gpt2", HF["gpt2"]),
    **_cases("llama", HF["llama"]),
    "routed zb-h1": train_config(
        schedule="zb-h1",
        num_stages=2,
        num_microbatches=4,
        model=ROUTED,
        batch_size=8,
        steps=STEPS,
        collect_parameters=True,
    ),
    "gpt2 1f1b variable lengths": train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=4,
        model=HF["gpt2"],
        batch_size=8,
        steps=STEPS,
        collect_parameters=True,
        min_seq_len=5,
    ),
}


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


def _launch(cases: dict[str, TrainConfig]) -> dict[str, tuple[TrainConfig, RunRecord]]:
    for config in cases.values():
        prepare(config)
    records = launch(_run_all, list(cases.values()), 2, LaunchOptions(timeout_s=120))
    return {name: (config, record) for (name, config), record in zip(cases.items(), records)}


@pytest.fixture(scope="module")
def fast_runs() -> dict[str, tuple[TrainConfig, RunRecord]]:
    return _launch(FAST)


@pytest.fixture(scope="module")
def slow_runs() -> dict[str, tuple[TrainConfig, RunRecord]]:
    return _launch(SLOW)


def equals_unsplit(config: TrainConfig, record: RunRecord) -> None:
    losses, params = train_unsplit(config)
    torch.testing.assert_close(record.losses, losses, rtol=1e-5, atol=1e-6)
    seen = set()
    for rank in record.ranks:
        for stage_params in rank.parameters.values():
            for name, value in stage_params.items():
                original = name.partition(".")[2]
                if original in params:  # not a deferrable layer's second name for the same Parameter
                    torch.testing.assert_close(value, params[original].detach(), rtol=1e-5, atol=1e-6)
                    seen.add(original)
    assert {id(params[n]) for n in seen} == {id(p) for p in params.values()}  # every Parameter, by any name


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [c for c in FAST if "pipedream" not in c])
def test_a_split_module_trains_as_the_unsplit_module(fast_runs: dict[str, Any], case: str) -> None:
    equals_unsplit(*fast_runs[case])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_split_sequential_on_a_stream_equals_its_reference(fast_runs: dict[str, Any], equals_reference: Any) -> None:
    equals_reference(*fast_runs["sequential pipedream"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(SLOW))
def test_interleaved_and_hugging_face_models_train_as_the_unsplit_module(slow_runs: dict[str, Any], case: str) -> None:
    equals_unsplit(*slow_runs[case])
