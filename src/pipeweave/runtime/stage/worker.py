"""One stage's computation: F, B, I, W and U of a consecutive slice of layers, on one process.

This is the unit both executors drive (``runtime/reference.py`` in one process,
the torch.distributed executor one rank per process). It knows nothing of
schedules, ranks or communication: an executor calls one method per action and
moves the tensors between stages.

``StageWorker(spec, layers, batch_size=...)`` builds a stage by the ordered
steps of ``stage.build``; a run builds its stages by those and its own
(``runtime.run.workers``) and takes the result (``from_stage``). A built worker
is sealed: its public attributes cannot be set from outside.

The layers are initialised from ``(spec.seed, layer index)`` only, so every
replica of a part, on any rank, starts equal to the same layers of plain
training. The first stage is the one whose layers start at 0 (it takes the
data inputs), the last the one whose layers end at ``spec.num_layers`` (it
takes the targets and computes the loss); a one-part model is both.

Tensors in and out (microbatch ``mb`` is the IR's microbatch index):

- ``forward(mb, x, target=None)``: ``x`` is the microbatch's data input on the
  first stage (float (b, h) for the mlp, int64 (b, seq) tokens for the gpt) or
  the previous stage's output otherwise. Returns this stage's output, detached
  (send it to the next stage as is). On the last stage pass ``target`` (the
  microbatch's slice of the targets); it returns the microbatch's loss scaled
  by its share of the mini-batch, ``mean_loss * b / batch_size``, detached:
  the sum over microbatches is the mini-batch mean loss. A mixture of
  experts' auxiliary losses (``models.moe``) are part of the objective on
  the stage that computes them: the last stage's are added to the loss it
  returns; another stage's are ``take_aux_loss()`` after its F (the
  executors add them to the loss they report).
- ``backward(mb, grad_output)`` (B) / ``backward_input(mb, grad_output)`` (I):
  ``grad_output`` is the gradient of this stage's output received from the
  next stage; on the last stage None (the loss is the root) or the gradient
  the loss's backward starts from (``--precision fp16``: the loss scale,
  ``runtime.loss_scale``). Returns the gradient of the stage input to send
  back, or None on the first stage.
- ``backward_weight(mb)`` (W): accumulates the weight gradients that I
  deferred. B accumulates them at once.
- A custom model's layers may pass tuples of tensors (``models.boundary``):
  then ``x`` and the output are tuples, a ``grad_output`` or an input
  gradient is the tuple of the floating-point elements' gradients.
- ``update(combine=None)`` (U): calls ``combine(worker)`` if given, then the
  optimizer step, then zeroes the gradients; ``update(skip=True)`` leaves out the step.
- ``evaluate(x, target=None)``: F for evaluation (``schedule.evaluation``):
  the same output or scaled loss, computed without a graph, nothing kept.

Replicated parts (Chimera, GEMS, DualPipe: several stages hold one part): each
replica's gradients cover only its own microbatches, each already scaled by
its share of the whole mini-batch, so the part's gradient is the SUM over
replicas. Pass ``update`` a ``combine`` that all-reduces (sum)
``worker.gradients()`` in place across the replicas (it returns the gradient
tensors in a fixed order, zero-filled if a replica had no microbatch); the
reference executor sums them in-process.

Tensors given to and returned by a worker are shared with what it keeps for
the backward (``x`` and ``grad_output`` may be held until W): never modify
them in place or reuse their buffers for later microbatches.

Random numbers: a custom model's layers draw from torch's generator reseeded
by (model seed, ``steps_done``, microbatch, layer) before each layer call
(``models.randomness``), so their dropout masks are plain training's, on any
rank and in a replay; give ``steps_done`` when resuming.

ZeRO-3 (``stage.shards``): where the build sharded the stage (``worker.shards``), the layers are
FSDP2 units (``runtime.fsdp``): each gathers its parameters itself around
its forward and backward; code outside an action reads them whole inside
``whole_weights()``.

Accounting: ``weight_bytes()``; ``activation_bytes()`` and
``peak_activation_bytes()`` count, through saved-tensor hooks, the distinct
storages currently held for a backward (graph tensors, kept stage inputs and
outputs, and the inputs/output gradients a deferred W still needs),
parameters excluded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary, num_samples, tensors
from pipeweave.models.layers import WeightGrad
from pipeweave.models.precision import autocast
from pipeweave.models.precision import check as precision_check
from pipeweave.models.randomness import is_keyed, run_keyed
from pipeweave.models.spec import ModelSpec, loss_fn
from pipeweave.runtime.stage.build import OptimizerFactory, Sealed, Stage, build_stage, sgd, stage_options
from pipeweave.runtime.stage.levers import stash_hooks
from pipeweave.runtime.stage.memory import Metered, own, unpack
from pipeweave.runtime.stage.tensor_parallel import TensorParallel

__all__ = ["Combine", "OptimizerFactory", "StageWorker", "sgd"]

Combine = Callable[["StageWorker"], None]
"""What a ``U`` runs before the optimizer step: the rank's gradient exchanges of that stage (``update``)."""


@dataclass
class _Microbatch:
    """What a stage keeps of one microbatch between its F and its backward."""

    input: Boundary
    output: Boundary | None  # None under recomputation: replayed before the backward
    target: Boundary | None
    keys: list[int | None]
    step: int  # steps done at F: a replay draws F's random numbers
    held: list[Any] | None = None  # what autograd saved (stage.memory._Held), when the stage stashes (stage.levers)


class StageWorker(Sealed, Metered):
    """Runs the actions of one stage; see the module docstring for the contract.

    Args:
        spec: the model.
        layer_indices: the consecutive layers of this stage's part.
        optimizer_factory: builds the optimizer from the parameters (default SGD lr 0.1).
        batch_size: mini-batch size, to scale each microbatch's loss by its share.
        recompute: ``none``; ``full`` (or True): keep only the stage input at F and replay the forward
            before the backward (exact: a custom model's layers redraw F's random numbers, and running
            statistics are left as F left them); ``selective``: replay only the submodules the model
            names (``stage.selective``: the gpt's attention core).
        device: where the layers live; inputs must be given on it.
        track_memory: count activation bytes with saved-tensor hooks.
        precision: ``fp32``, ``bf16`` or ``fp16`` (every forward under bfloat16 or float16 autocast;
            ``models.precision``; fp16's loss scale is the last stage's ``grad_output``).
        tensor_parallel: this rank's tensor-parallel group: the layers are split over it
            (``stage.tensor_parallel``, by the model's plan); every rank of the group runs the same
            actions on its shard.
        compress: saved tensors kept in bfloat16 from F to the backward; ``stashing``: kept per microbatch
            (memory actions move them: ``stage.levers``); ``steps_done``: updates done before (a resumed run);
            ``compile``: the ``torch.compile`` backend of the layers (``stage.compiled``; None: eager).

    Raises:
        UserError: an empty or non-consecutive layer range, or batch_size < 1.

    Example:
        >>> spec = ModelSpec(kind="mlp", layers=2, hidden=4)
        >>> w = StageWorker(spec, range(2), batch_size=2)
        >>> loss = w.forward(0, torch.ones(2, 4), target=torch.zeros(2, 4))
        >>> w.backward(0, None) is None, w.activation_bytes()
        (True, 0)
    """

    def __init__(
        self,
        spec: ModelSpec,
        layer_indices: Iterable[int],
        *,
        batch_size: int,
        optimizer_factory: OptimizerFactory | None = None,
        recompute: bool | str = False,
        device: torch.device | str = "cpu",
        track_memory: bool = True,
        precision: str = "fp32",
        tensor_parallel: TensorParallel | None = None,
        compress: bool = False,
        stashing: bool = False,
        steps_done: int = 0,
        compile: str | None = None,
    ) -> None:
        options = stage_options(
            spec,
            layer_indices,
            batch_size=batch_size,
            optimizer_factory=optimizer_factory,
            recompute=recompute,
            device=device,
            track_memory=track_memory,
            precision=precision,
            tensor_parallel=tensor_parallel,
            compress=compress,
            stashing=stashing,
            steps_done=steps_done,
            compile=compile,
        )
        self._adopt(build_stage(options))

    @classmethod
    def from_stage(cls, stage: Stage) -> StageWorker:
        """The worker of a stage a run built by its own steps (``runtime.run.workers``), sealed."""
        worker = cls.__new__(cls)
        worker._adopt(stage)
        return worker

    def _adopt(self, stage: Stage) -> None:
        """Take what the build steps made (``stage.build``); then seal: no public attribute changes after."""
        options, indices = stage.options, stage.options.layer_indices
        self.spec, self.layer_indices, self.batch_size = options.spec, indices, options.batch_size
        self.recompute, self.tensor_parallel = options.recompute, options.tensor_parallel
        self.is_first, self.is_last = indices.start == 0, indices.stop == options.spec.num_layers
        self.module, self.store, self.shards, self.meter = stage.module, stage.store, stage.shards, stage.meter
        self.optimizer_factory = options.optimizer_factory
        """What built ``optimizer`` (ZeRO builds the same over its slices, ``runtime.zero``)."""
        self.optimizer = stage.optimizer
        self.loss = loss_fn(options.spec)
        self._track_memory, self._steps_done = options.track_memory, options.steps_done
        self._saved: dict[int, _Microbatch] = {}
        self._weight_grads: dict[int, list[tuple[WeightGrad, tuple[torch.Tensor, ...]]]] = {}
        self._stash_keys: dict[int, list[int | None]] = {}
        self._backward_ran = False  # in this step (since the last U)
        self.keyed, self.device = is_keyed(options.spec), options.device
        self.precision = precision_check(options.precision)
        self._buffers = list(self.module.buffers())  # running statistics, left as F left them by a replay
        # Saved tensors in bfloat16 from F to the backward; what autograd saves kept per microbatch (stage.levers).
        self.compress, self.stashing = stage.compress, stage.stashing
        self.aux_losses = stage.aux_losses
        self._aux_loss: torch.Tensor | None = None
        self._sealed = True

    @property
    def steps_done(self) -> int:
        """Updates done (a resumed run's included): a key of a custom layer's random numbers."""
        return self._steps_done

    def start_at(self, steps_done: int) -> None:
        """Go on from ``steps_done`` updates (a stream of a run starting after the mini-batches before it)."""
        self._steps_done = steps_done

    @property
    def track_memory(self) -> bool:
        """Whether saved-tensor hooks count the activation bytes (``track_memory_from_now`` turns it off)."""
        return self._track_memory

    def track_memory_from_now(self, on: bool) -> None:
        """Count activation bytes from now on (True) or stop counting (a run measures its first step only)."""
        self._track_memory = on

    # ---- F ----------------------------------------------------------------
    def forward(self, mb: int, x: Boundary, target: Boundary | None = None) -> Boundary:
        """F: run the stage on microbatch ``mb``; returns the output, or the scaled loss on the last stage."""
        if mb in self._saved:
            raise RuntimeError(f"stage {self.layer_indices} got F for microbatch {mb} twice before its backward")
        if self.is_last and target is None:
            raise RuntimeError("the last stage needs the microbatch's target to compute the loss")
        x = boundary.apply(self._input, x)
        target = None if target is None else boundary.apply(own, target)
        self.aux_losses.take()  # nothing but this F's
        if self.recompute == "full":
            with torch.no_grad():
                out = self._run(x, target, mb, self.steps_done)
            record = _Microbatch(x, None, target, [self._hold(t) for t in tensors(x)], self.steps_done)
        else:
            saved: list[Any] | None = [] if self.stashing else None
            with self._hooks(saved, x):
                out = self._run(x, target, mb, self.steps_done)
            held = [self._hold(t) for t in tensors(x)] + [self._hold(t) for t in tensors(out)]
            record = _Microbatch(x, out, target, held, self.steps_done, saved)
        self._saved[mb] = record
        return self._with_aux_loss(boundary.apply(torch.Tensor.detach, out))

    def _with_aux_loss(self, out: Boundary) -> Boundary:
        """The last stage's loss with its MoE layers' auxiliary losses added; another stage keeps them for
        ``take_aux_loss``."""
        aux = self.aux_losses.take()
        if not self.is_last:
            self._aux_loss = aux
            return out
        return out if aux is None else out + aux  # type: ignore[operator]

    def take_aux_loss(self) -> torch.Tensor | None:
        """The auxiliary losses (scaled, detached) of the last F on a stage other than the last, once; None
        where it has no MoE layer (the last stage's are inside the loss its F returns)."""
        aux, self._aux_loss = self._aux_loss, None
        return aux

    def _input(self, t: torch.Tensor) -> torch.Tensor:
        t = own(t.detach())
        if not self.is_first and t.is_floating_point():
            t.requires_grad_(True)  # a leaf: its .grad is the input gradient to send back
        return t

    def evaluate(self, x: Boundary, target: Boundary | None = None) -> Boundary:
        """F for evaluation: the output (or scaled loss) of ``forward`` in ``eval()`` mode, no graph, nothing kept."""
        if self.is_last and target is None:
            raise RuntimeError("the last stage needs the microbatch's target to compute the loss")
        self.module.eval()  # dropout off, batch norm on its running statistics (custom models)
        try:
            with torch.no_grad():
                return self._run(x, target, None, self.steps_done)
        finally:
            self.module.train()
            self.aux_losses.take()  # an evaluation reports the model's loss alone

    def _run(self, x: Boundary, target: Boundary | None, mb: int | None, step: int) -> Boundary:
        with autocast(self.precision, self.device):
            return self._run_layers(x, target, mb, step)

    def _run_layers(self, x: Boundary, target: Boundary | None, mb: int | None, step: int) -> Boundary:
        if self.keyed and mb is not None:  # models.randomness: the masks plain training draws
            x = run_keyed(
                zip(self.layer_indices, self.module.values()),
                x,
                seed=self.spec.seed,
                step=step,
                microbatch=mb,
                device=self.device,
            )
        else:
            for layer in self.module.values():
                x = boundary.call(layer, x)
        if not self.is_last:
            return x
        assert target is not None
        # The microbatch's share of the mini-batch: the shares' sum makes the mean loss.
        return self.loss(x, target) * (num_samples(target) / self.batch_size)

    # ---- B, I, W -----------------------------------------------------------
    def backward(self, mb: int, grad_output: Boundary | None = None) -> Boundary | None:
        """B: input and weight gradients of microbatch ``mb``; returns the input gradient (None on the first stage)."""
        return self._backward(mb, grad_output, defer=False)

    def backward_input(self, mb: int, grad_output: Boundary | None = None) -> Boundary | None:
        """I: the input gradient only; the weight gradients wait for ``backward_weight(mb)``."""
        return self._backward(mb, grad_output, defer=True)

    def backward_weight(self, mb: int) -> None:
        """W: accumulate the weight gradients that ``backward_input(mb)`` deferred."""
        closures = self._weight_grads.pop(mb, None)
        if closures is None:
            raise RuntimeError(f"W of microbatch {mb} before its I on stage {self.layer_indices}")
        with torch.no_grad():
            for fn, _ in closures:
                fn()
        closures.clear()
        self._release(self._stash_keys.pop(mb))

    def _backward(self, mb: int, grad_output: Boundary | None, *, defer: bool) -> Boundary | None:
        self._backward_ran = True
        record = self._saved.pop(mb, None)
        if record is None:
            raise RuntimeError(f"backward of microbatch {mb} before its F on stage {self.layer_indices}")
        out = record.output
        kept: list[torch.Tensor] = []
        if out is None:  # recomputation: replay the forward, now recording the graph
            kept = [b.clone() for b in self._buffers]  # F already updated the running statistics
            with torch.enable_grad(), self._hooks():
                out = self._run(record.input, record.target, mb, record.step)
            self.aux_losses.take()  # F recorded them
        if not self.is_last and grad_output is None:
            raise RuntimeError("a backward on a stage other than the last needs grad_output")
        self.store.deferring = defer
        try:
            if isinstance(out, torch.Tensor):
                if out.requires_grad:  # the last stage: from 1, or from the loss scale given
                    torch.autograd.backward(out, grad_output)
            else:  # a tuple: from its floating-point outputs that have a graph
                assert grad_output is not None
                outputs, grads = boundary.roots(out, grad_output)
                if outputs:
                    torch.autograd.backward(outputs, grads)
        finally:
            self.store.deferring = False
        with torch.no_grad():  # after the backward: the replayed graph may hold the buffers
            for buffer, value in zip(self._buffers, kept):
                buffer.copy_(value)
        if defer:
            closures, self.store.pending = self.store.pending, []
            self._weight_grads[mb] = closures
            self._stash_keys[mb] = [self._hold(t) for _, held in closures for t in held]
        grad_input = None if self.is_first else boundary.input_gradient(record.input)
        del out
        record.output = None
        self._release(record.keys)
        return grad_input

    def prepare_gradients(self) -> None:
        """Give every parameter without a gradient a zero one now, before the step's first backward.

        For a rank waiting on a message (a bubble): the first backward then accumulates into memory just
        written instead of allocating its gradients cold (slower: benchmarks/runtime/README.md). Zero plus
        the first gradient is that gradient. A no-op once a backward of the step has run, and under ZeRO-3
        (the parameters between actions are FSDP's shards, whose gradients FSDP's reduction writes).
        """
        if self._backward_ran or self.shards is not None:
            return
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    # ---- U -----------------------------------------------------------------
    def update(self, skip: bool = False, combine: Combine | None = None) -> None:
        """U: combine the gradients (``combine``: the replicas' sum, the ties', clipping), optimizer step, zero them.

        ``skip``: the step's update is skipped (a non-finite loss): the gradients are combined all the same
        (the exchanges take place), then dropped; parameters and optimizer state stay exactly as they were.
        An optimizer that takes part in every step (the post-validated one passes its state down the
        pipeline) is told through its ``skip_step``.
        """
        if self._weight_grads:
            raise RuntimeError(
                f"U on stage {self.layer_indices} with W pending for microbatches {list(self._weight_grads)}"
            )
        if combine is not None:
            combine(self)
        if not skip:
            self.optimizer.step()
        elif hasattr(self.optimizer, "skip_step"):
            self.optimizer.skip_step()
        self.optimizer.zero_grad(set_to_none=True)
        self._backward_ran = False
        self._steps_done += 1

    def gradients(self) -> list[torch.Tensor]:
        """The parameters' gradient tensors in parameter order, created as zeros where missing (for all-reduce)."""
        grads = []
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters by global name ``"<layer index>.<name in layer>"``, as in plain training."""
        return dict(self.module.named_parameters())

    # ---- accounting ----------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of this stage's parameters (of their slices kept between actions, where sharded)."""
        if self.shards is not None:
            return self.shards.weight_bytes()
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def whole_weights(self) -> AbstractContextManager[None]:
        """The parameters whole inside, for code outside an action: gathered and freed after where sharded
        (``shards``; written values kept), else as they are."""
        return contextlib.nullcontext() if self.shards is None else self.shards.gathered()

    @property
    def in_flight(self) -> list[int]:
        """Microbatches with a forward and no finished backward (I done, W pending counts)."""
        return sorted(set(self._saved) | set(self._weight_grads))

    # ---- helpers -------------------------------------------------------------
    def _hooks(self, saved: list[Any] | None = None, x: Boundary | None = None) -> Any:
        if saved is not None or (self.compress and x is not None):  # F, moving or compressing (stage.levers)
            return stash_hooks(
                self.meter,
                saved,
                counted=self.track_memory,
                compress_except=None if not self.compress or x is None else tensors(x),
            )
        if not self.track_memory:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.meter.pack, unpack)
