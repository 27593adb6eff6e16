"""A stage built by ordered steps, as torchtitan's ``parallelize_*`` makes a model parallel: nothing patches it after.

A ``Stage`` is a stage under construction. Each step is a function taking it
and its ``StageOptions`` and filling in what it owns; ``STEPS`` lists them in
the order they run::

    split_layers            the part's layers, initialised from (seed, layer index): plain training's
    apply_tensor_parallel   sequence parallelism over the process's tp group (each layer was cut by the
                            model's plan as split_layers built it: only this rank's shard materialised)
    apply_context_parallel  attention by ring attention over the process's cp group, positions global
    apply_expert_parallel   each MoE layer's share of the experts kept, tokens sent to them by all-to-all
    apply_recompute         selective recomputation: the model's named submodules checkpointed
    place                   the layers on the device, the deferred weight gradients' store wired in
    apply_compile           --compile: each layer through torch.compile, the split backward kept
    apply_memory_levers     saved tensors compressed (bfloat16) and/or kept per microbatch to move them
    apply_optimizer         the optimizer over the parameters

A run adds its own steps after these (``runtime.run.workers``: sharding over
the data-parallel replicas -- FSDP2 or ZeRO-1 --, the post-validated weight
policy), then ``StageWorker.from_stage`` seals the result: from then on the
worker refuses any assignment to its public attributes. Gradient exchanges
between stages (replicas, ties, sequence-parallel sums, clipping) belong to
the rank, not the stage: the executor passes them to each ``U``
(``StageWorker.update(combine=...)``).

Example:
    >>> from pipeweave.models.spec import ModelSpec
    >>> stage = build_stage(stage_options(ModelSpec(kind="mlp", layers=2, hidden=4), range(1, 2), batch_size=2))
    >>> list(stage.module), type(stage.optimizer).__name__
    (['1'], 'SGD')
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.build import build_layers
from pipeweave.models.layers import Deferrable, WeightGradStore
from pipeweave.models.moe import AuxLosses, attach_aux_losses
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.stage.compiled import compile_layers
from pipeweave.runtime.stage.context_parallel import ContextParallel, shard_layers
from pipeweave.runtime.stage.expert_parallel import ExpertParallel, shard_experts
from pipeweave.runtime.stage.memory import ActivationMeter
from pipeweave.runtime.stage.selective import checkpoint_submodules
from pipeweave.runtime.stage.sequence_parallel import shard_sequence
from pipeweave.runtime.stage.shards import Shards
from pipeweave.runtime.stage.tensor_parallel import TensorParallel, cut_over
from pipeweave.sim.recompute import parse_recompute

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def sgd(lr: float = 0.1) -> OptimizerFactory:
    """The default optimizer factory: plain SGD with learning rate ``lr``."""
    return lambda params: torch.optim.SGD(params, lr=lr)


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """What one stage is built from (``stage_options`` checks it; ``StageWorker`` lists each field's meaning)."""

    spec: ModelSpec
    layer_indices: range
    batch_size: int
    optimizer_factory: OptimizerFactory
    recompute: str
    device: torch.device
    track_memory: bool = True
    precision: str = "fp32"
    tensor_parallel: TensorParallel | None = None
    context_parallel: ContextParallel | None = None
    expert_parallel: ExpertParallel | None = None
    """The ``ep`` group the MoE layers' experts are split over (``stage.expert_parallel``); None: all here."""
    compress: bool = False
    stashing: bool = False
    steps_done: int = 0
    compile: str | None = None
    """The ``torch.compile`` backend the layers are compiled with (``stage.compiled``); None: eager."""


def stage_options(
    spec: ModelSpec,
    layer_indices: Iterable[int],
    *,
    batch_size: int,
    optimizer_factory: OptimizerFactory | None = None,
    recompute: bool | str = False,
    device: torch.device | str = "cpu",
    **rest: Any,
) -> StageOptions:
    """``StageOptions`` from ``StageWorker``'s arguments.

    Raises:
        UserError: an empty or non-consecutive layer range, batch_size < 1, several recomputation modes.
    """
    indices = list(layer_indices)
    if not indices or indices != list(range(indices[0], indices[0] + len(indices))):
        raise UserError(f"layer indices {indices} are not a non-empty consecutive range; give range(start, stop)")
    if batch_size < 1:
        raise UserError(f"batch_size={batch_size} is invalid; give batch_size >= 1")
    modes = parse_recompute(recompute)
    if len(modes) != 1:
        raise UserError(f"recompute={recompute!r} gives several modes; a stage takes its own part's one")
    return StageOptions(
        spec=spec,
        layer_indices=range(indices[0], indices[-1] + 1),
        batch_size=batch_size,
        optimizer_factory=optimizer_factory or sgd(),
        recompute=modes[0],
        device=torch.device(device),
        **rest,
    )


@dataclass
class Stage:
    """A stage under construction: what the steps have built so far."""

    options: StageOptions
    layers: list[nn.Module] = field(default_factory=list)
    module: nn.ModuleDict = field(default_factory=nn.ModuleDict)
    store: WeightGradStore = field(default_factory=WeightGradStore)
    optimizer: Any = None
    """The torch optimizer, or what stands in for one (``runtime.zero``, ``stage.post_validation``)."""
    shards: Shards | None = None
    """ZeRO-3: FSDP2's shards of the parameters between actions (``runtime.fsdp``)."""
    meter: ActivationMeter = field(default_factory=lambda: ActivationMeter(set()))
    """Counts the activation bytes held for backwards, parameters left out (``place`` makes it)."""
    compress: bool = False
    stashing: bool = False
    aux_losses: AuxLosses = field(default_factory=AuxLosses)
    """The auxiliary losses its MoE layers computed (``models.moe``), each scaled by its microbatch's share."""

    # What the steps of a run read of a stage, as they read it of a built worker.
    @property
    def spec(self) -> ModelSpec:
        return self.options.spec

    @property
    def layer_indices(self) -> range:
        return self.options.layer_indices

    @property
    def optimizer_factory(self) -> OptimizerFactory:
        return self.options.optimizer_factory

    @property
    def device(self) -> torch.device:
        return self.options.device

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())


StageStep = Callable[[Stage, StageOptions], None]


class Sealed:
    """An object whose public attributes cannot be set once it is sealed (``_sealed``): what a built stage's
    worker is, so that nothing patches it from outside its construction. Private state (``_name``) is its own."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and getattr(self, "_sealed", False):
            raise AttributeError(
                f"{type(self).__name__}.{name} is fixed once the stage is built; give it to the "
                f"build (runtime.stage.build, runtime.run.workers) instead of setting it after"
            )
        object.__setattr__(self, name, value)


def split_layers(stage: Stage, options: StageOptions) -> None:
    """The part's layers, built from ``(seed, layer index)``: plain training's weights; over a tensor-parallel
    group, each cut by the model's plan as it is built (a layer built on the meta device materialises only this
    rank's shard: ``stage.tensor_parallel.cut_over``)."""
    tp = options.tensor_parallel
    cut = cut_over(options.spec, tp) if tp is not None and tp.size > 1 else None
    stage.layers = build_layers(options.spec, list(options.layer_indices), cut)


def apply_tensor_parallel(stage: Stage, options: StageOptions) -> None:
    """The layers (cut over the tensor-parallel group as they were built) sequence-parallel where the group
    says so (``stage.sequence_parallel``)."""
    tp = options.tensor_parallel
    if tp is not None and tp.size > 1 and tp.sequence_parallel:
        shard_sequence(list(options.layer_indices), stage.layers, tp)


def apply_context_parallel(stage: Stage, options: StageOptions) -> None:
    """Each sequence split over the context-parallel group: the attention cores by ring attention, the layers
    that read positions told the global ones (``stage.context_parallel``)."""
    cp = options.context_parallel
    if cp is not None and cp.size > 1:
        shard_layers(options.spec, list(options.layer_indices), stage.layers, cp)


def apply_expert_parallel(stage: Stage, options: StageOptions) -> None:
    """Each MoE layer keeps its ``ep`` rank's share of the experts, tokens exchanged by all-to-all
    (``stage.expert_parallel``)."""
    if options.expert_parallel is not None:
        for layer in stage.layers:
            shard_experts(layer, options.expert_parallel)


def apply_recompute(stage: Stage, options: StageOptions) -> None:
    """Selective recomputation: the submodules the model names replay at the backward (``stage.selective``).
    Full recomputation is the worker's F itself (it keeps only the stage input)."""
    if options.recompute == "selective":
        checkpoint_submodules(options.spec, zip(options.layer_indices, stage.layers))


def place(stage: Stage, options: StageOptions) -> None:
    """The layers on the device, named by layer index; deferrable layers given the stage's W store, MoE layers
    its auxiliary losses' record; the activation meter, which counts every storage but the parameters'."""
    stage.module = nn.ModuleDict({str(i): layer for i, layer in zip(options.layer_indices, stage.layers)})
    stage.module.to(options.device)
    for m in stage.module.modules():
        if isinstance(m, Deferrable):
            m.grad_store = stage.store
    stage.aux_losses = attach_aux_losses(stage.module, options.batch_size)
    stage.meter = ActivationMeter({p.untyped_storage().data_ptr() for p in stage.module.parameters()})


def apply_compile(stage: Stage, options: StageOptions) -> None:
    """``--compile``: each layer through ``torch.compile``, its deferrable modules eager (``stage.compiled``)."""
    if options.compile is not None:
        compile_layers(stage.module.values(), backend=options.compile)


def apply_memory_levers(stage: Stage, options: StageOptions) -> None:
    """Saved tensors compressed from F to the backward, and/or kept per microbatch where memory actions move
    them (OFFLOAD, BPipe's EVICT: ``stage.levers``)."""
    stage.compress, stage.stashing = options.compress, options.stashing


def apply_optimizer(stage: Stage, options: StageOptions) -> None:
    """The optimizer over the stage's parameters. torch's optimizers refuse an empty list: a part of
    activations only gets a placeholder, never given a gradient."""
    params = list(stage.module.parameters())
    stage.optimizer = options.optimizer_factory(params or [nn.Parameter(torch.zeros(1, device=options.device))])


STEPS: tuple[StageStep, ...] = (
    split_layers,
    apply_tensor_parallel,
    apply_context_parallel,
    apply_expert_parallel,
    apply_recompute,
    place,
    apply_compile,
    apply_memory_levers,
    apply_optimizer,
)
"""A stage's own steps, in order (module docstring)."""


def build_stage(options: StageOptions, steps: Sequence[StageStep] = STEPS) -> Stage:
    """A ``Stage`` built from ``options`` by ``steps``, in order."""
    stage = Stage(options)
    for step in steps:
        step(stage, options)
    return stage
