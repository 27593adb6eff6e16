"""``pipeweave.pipeline``: a module cut at named points, or into D parts balanced by the profiler.

The public entry over ``models.pipeline`` (tracing and cutting) and
``runtime.profile`` (the costs). With ``split_points=D`` the module is first
cut before every block of its ``nn.ModuleList`` s (``models.pipeline.block_starts``); each
piece is profiled as a layer of a run is (F, I and W of one microbatch of
the dataset, as many samples as the example inputs), the ``time``
partitioner chooses the D-way split of least slowest part
(``partition.methods.time``, exact), and the module is cut there. The
chosen names are the LayerModel's ``split_points``, as
torch.distributed.pipelining's ``split_policy`` leaves its choice in the graph.

Costs are measured on one thread and cached (``runtime.profile``) under a
digest of the pieces' graphs, parameter shapes and data shapes, so each
rank that builds the model after the first (spawned ranks after the
launcher's ``prepare``, whatever their thread count) reads the same costs
and cuts at the same names. Where the default process group exists when
the split is chosen (a torchrun script that initialised it first), rank 0
alone profiles and every rank takes its names. Ranks that choose apart
(torchrun with nothing cached and no group yet) are stopped in one line
when their run starts (``runtime.run.agreement.check_split``): give them
the names once chosen.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.boundary import num_samples
from pipeweave.models.custom import LayerModel, hold
from pipeweave.models.pipeline import pipeline as split_at
from pipeweave.models.spec import ModelSpec
from pipeweave.partition.methods import partition
from pipeweave.runtime.profile import profile_model
from pipeweave.runtime.run.agreement import rank0_decides


def pipeline(
    module: nn.Module,
    example_inputs: Any = None,
    split_points: Sequence[str] | int | None = None,
    *,
    loss: Callable[[Any, Any], torch.Tensor],
    dataset: Any,
    eval_dataset: Any = None,
    param_init: Callable[[nn.Module], None] | None = None,
    seed: int | None = None,
    tp_plan: Mapping[str, Any] | None = None,
) -> LayerModel:
    """``module`` as a ``LayerModel``, cut at ``split_points``: module names, or D parts balanced by time.

    Args:
        module, example_inputs, loss, dataset, eval_dataset, param_init, seed, tp_plan: as
            ``models.pipeline.pipeline``'s (``param_init`` and ``seed``: for a module on the meta device,
            materialised per part); with
            ``split_points=D`` the example inputs' samples are the profiled microbatch's.
        split_points: module names, each starting a new layer; an int D: the D-way split of least slowest
            part among the cuts before the blocks of the module's ``nn.ModuleList`` s, by profiled time;
            None: a cut before every such block.

    Raises:
        UserError: as ``models.pipeline.pipeline``; D below 1 or above the pieces.

    Example:
        >>> m = pipeline(net, (tokens[:4],), 2, loss=token_loss, dataset=data)   # doctest: +SKIP
        >>> m.split_points   # where the profiler's balanced split cut
        ('blocks.2',)
    """
    given = {
        "loss": loss,
        "dataset": dataset,
        "eval_dataset": eval_dataset,
        "param_init": param_init,
        "seed": seed,
        "tp_plan": tp_plan,
    }
    if not isinstance(split_points, int) or isinstance(split_points, bool):
        return split_at(module, example_inputs, split_points, **given)
    num_parts = split_points
    if num_parts < 1:
        raise UserError(f"split_points={num_parts} parts is invalid; give D >= 1 parts or a list of module names")
    pieces = split_at(module, example_inputs, None, **given)
    samples = num_samples(example_inputs) if example_inputs is not None else 2
    chosen = balanced_points(pieces, num_parts, samples, _digest(module, pieces, samples))
    return split_at(module, example_inputs, chosen, **given)


def balanced_points(pieces: LayerModel, num_parts: int, microbatch_size: int, digest: str) -> list[str]:
    """The module names where the ``time`` partitioner's D-way split of ``pieces`` (profiled) starts its parts:
    rank 0's, where a process group exists (``runtime.run.agreement.rank0_decides``: it alone profiles).

    Raises:
        UserError: more parts than pieces.
    """
    if num_parts > len(pieces.layers):
        raise UserError(
            f"split_points={num_parts} parts, but the module has {len(pieces.layers)} pieces to group "
            f"(cut before {', '.join(pieces.split_points[:4])}, ...); give at most "
            f"{len(pieces.layers)} parts or name the split points"
        )
    return rank0_decides(lambda: _profiled_points(pieces, num_parts, microbatch_size, digest))


def _profiled_points(pieces: LayerModel, num_parts: int, microbatch_size: int, digest: str) -> list[str]:
    spec = ModelSpec(kind="custom", entry=hold(pieces, digest))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as ranks run by default; the cache key holds it: one key in every process
    try:
        costs = profile_model(spec, microbatch_size, device=device)
    finally:
        torch.set_num_threads(threads)
    counts = partition("time", costs, num_parts).counts
    return [pieces.split_points[start - 1] for start in itertools.accumulate(counts[:-1])]


def _digest(module: nn.Module, pieces: LayerModel, samples: int) -> str:
    """What the pieces' costs depend on besides the machine: their code, parameter shapes and the data's."""
    text = [type(module).__qualname__, str(samples), *pieces.split_points]
    for build in pieces.layers:
        part = getattr(build, "args", (None,))[0]
        text.append(str(getattr(part, "code", part)))
    text += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in module.named_parameters()]
    text += [f"{tuple(t.shape)}:{t.dtype}" for t in _leaves(pieces.dataset[0])]
    return hashlib.sha256("\n".join(text).encode()).hexdigest()[:20]


def _leaves(sample: Any) -> list[torch.Tensor]:
    """The tensors of a dataset sample (nested tuples and lists)."""
    if isinstance(sample, torch.Tensor):
        return [sample]
    if isinstance(sample, (tuple, list)):
        return [t for item in sample for t in _leaves(item)]
    return []
