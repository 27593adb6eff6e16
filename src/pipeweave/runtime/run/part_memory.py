"""A part's memory for one microbatch, as a rank's meter counts it, measured before any rank is spawned.

``part_memory(config, parts)`` runs one microbatch through each part's
``StageWorker`` -- the same layers and the same saved-tensor accounting
(``stage.memory``) a rank reports as ``peak_activation_bytes`` -- and returns,
per part, what a microbatch holds from its F to its backward, what its W
still needs after its I, what a backward uses on top while it runs (a
recomputation's replayed forward), and its weight bytes.

Two ways, the cheaper that is exact:

- parts whose weights are small (``CPU_MEASURED_BYTES``) run on the CPU with
  one sample and with two, and the bytes are extrapolated to the microbatch:
  they are affine in its size (the loss is one number whatever the size);
- larger parts run the whole microbatch on the meta device: shapes without
  data, nothing computed or allocated whatever the model's size. It costs
  once the import of torch's compiler, which its meta kernels need (seconds).
  There ``_AsOnCpu`` makes it keep what the CPU keeps: attention through the
  CPU's fused kernel, losses in float32 under autocast. A model the meta
  device cannot run (a custom layer that reads its data) is measured on the CPU.

Measurements are cached as JSON beside the profiler's (``$PIPEWEAVE_CACHE`` or
``~/.cache/pipeweave``, under ``memory/``), keyed by the model, the parts, the
microbatch size, precision, recomputation and the torch version: the first
backward in a process imports torch's symbolic shapes (about half a second),
which a cached run skips.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipeweave.config import TrainConfig
from pipeweave.data import data_source
from pipeweave.errors import UserError
from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary
from pipeweave.models.build import build_layers
from pipeweave.models.custom import fingerprint
from pipeweave.runtime.fsdp import padded_shard_bytes
from pipeweave.runtime.profile import default_cache_dir
from pipeweave.runtime.run.sizes import microbatch_sizes
from pipeweave.runtime.stage.build import STEPS, Stage, StageOptions, build_stage, stage_options
from pipeweave.runtime.stage.memory import ActivationMeter
from pipeweave.runtime.stage.tensor_parallel import MEASURING, TensorParallel
from pipeweave.runtime.stage.worker import StageWorker

CPU_MEASURED_BYTES = 256 << 20
"""Parts with at most these weight bytes are measured on the CPU (``part_memory``), larger ones on the meta device."""


@dataclass(frozen=True)
class PartMemory:
    """Bytes of one part for one microbatch, as a rank's meter counts them, and of its weights."""

    held: int
    """From the microbatch's F to its backward (its I under a split backward)."""
    stash: int
    """From its I to its W: what the deferred weight gradients still need."""
    during_b: int
    """On top of ``held`` while its full backward B runs (a recomputation's replayed forward)."""
    during_i: int
    """On top of ``held`` while its I runs (the replay, the gradients its W will need)."""
    weights: int
    """One copy of the part's parameters."""


def part_memory(
    config: TrainConfig,
    parts: Sequence[range],
    backwards: tuple[str, ...] = ("B", "I"),
    cache_dir: Path | str | None = None,
) -> list[PartMemory]:
    """Each part's bytes for one microbatch of the run's largest size (see the module docstring), cached.

    ``backwards``: the backward ops to measure, ``B`` and/or ``I`` (``_measure``); a part's
    ``during_b``, ``during_i`` and ``stash`` are 0 for those left out. ``cache_dir``: where
    measurements are kept (None: ``memory/`` beside the profiler's cache).
    """
    size = max(microbatch_sizes(config)[: config.schedule.num_microbatches * config.parallel.data_parallel])
    key = {
        "spec": asdict(config.model),
        "source": fingerprint(config.model.entry) if config.model.entry else None,
        "parts": [[p.start, p.stop] for p in parts],
        "size": size,
        "backwards": list(backwards),
        "precision": config.training.precision,
        "recompute": config.memory.recompute,
        "torch": torch.__version__,
        "compress": config.memory.compress_activations,
        "tensor_parallel": config.parallel.tensor_parallel,
        **({"sequence_parallel": True} if config.parallel.sequence_parallel else {}),
        **({"context_parallel": config.parallel.context_parallel} if config.parallel.context_parallel > 1 else {}),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir().parent / "memory"
    path = path / f"{digest}.json"
    try:
        return [PartMemory(*row) for row in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):  # not measured yet (or unreadable): measure
        pass
    found = _measured(config, parts, size, backwards)
    with contextlib.suppress(OSError):  # a read-only cache only costs the next run its measurement
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps([astuple(p) for p in found]))
        tmp.replace(path)  # atomic: a concurrent run never reads half of it
    return found


def _measured(config: TrainConfig, parts: Sequence[range], size: int, backwards: tuple[str, ...]) -> list[PartMemory]:
    """``part_memory`` measured: small parts on the CPU, extrapolated; large ones on the meta device."""
    if max(_part_weight_bytes(config, parts)) <= CPU_MEASURED_BYTES:
        return _extrapolated(config, parts, size, backwards)
    try:
        return _measure(config, parts, size, "meta", backwards)
    except UserError:
        raise
    except Exception:  # e.g. a custom layer the meta device cannot run
        return _extrapolated(config, parts, size, backwards)


def _extrapolated(
    config: TrainConfig, parts: Sequence[range], size: int, backwards: tuple[str, ...]
) -> list[PartMemory]:
    """Each part's bytes for ``size`` samples, from CPU runs of one and two (bytes affine in the size)."""
    one = _measure(config, parts, 1, "cpu", backwards)
    if size == 1:
        return one
    two = _measure(config, parts, 2, "cpu", backwards)

    def at(x: int, y: int) -> int:
        return x + (y - x) * (size - 1)

    return [
        PartMemory(
            at(p.held, q.held), at(p.stash, q.stash), at(p.during_b, q.during_b), at(p.during_i, q.during_i), p.weights
        )
        for p, q in zip(one, two)
    ]


def _part_weight_bytes(config: TrainConfig, parts: Sequence[range]) -> list[int]:
    """Bytes of each part's parameters, counted on the meta device (nothing allocated; all the CPU's if it fails)."""
    try:
        with torch.device("meta"), _AsOnCpu():
            return [
                sum(
                    p.numel() * p.element_size()
                    for layer in build_layers(config.model, list(part))
                    for p in layer.parameters()
                )
                for part in parts
            ]
    except UserError:
        raise
    except Exception:  # a custom layer built from data: measured on the CPU, which its probe already ran
        return [0 for _ in parts]


def sharded_layers(config: TrainConfig, parts: Sequence[range], replicas: int) -> list[list[tuple[int, int]]] | None:
    """Per part, per layer, ``(shard, whole)``: the bytes one of ``replicas`` keeps of the layer's parameters under
    FSDP2 (each parameter's dim 0 padded to a multiple of ``replicas``: ``fsdp.padded_shard_bytes``) and the
    layer's own bytes, of whole layers built on the meta device (nothing allocated); None where a custom layer
    cannot be built there.

    Example:
        >>> from pipeweave.models import ModelSpec
        >>> sharded_layers(TrainConfig(model=ModelSpec(kind="mlp", layers=2, hidden=3)), [range(0, 1)], 2)
        [[(216, 372)]]
    """
    try:
        with torch.device("meta"), _AsOnCpu():
            return [
                [
                    (
                        sum(padded_shard_bytes(p.shape, p.element_size(), replicas) for p in layer.parameters()),
                        sum(p.numel() * p.element_size() for p in layer.parameters()),
                    )
                    for layer in build_layers(config.model, list(part))
                ]
                for part in parts
            ]
    except UserError:
        raise
    except Exception:  # a custom layer built from data
        return None


def _measure(
    config: TrainConfig, parts: Sequence[range], size: int, device: str, backwards: tuple[str, ...] = ("B", "I")
) -> list[PartMemory]:
    """One microbatch of ``size`` samples through each part in turn on ``device``: F, then each of ``backwards``.

    A ``B`` (with its own F) measures what a full backward uses on top of what
    the microbatch held, an ``I`` that too and what its ``W`` still needs.
    """
    x, target = _sample(config, size, device)
    found = []
    # On the meta device, layers are built there (any modes active slow autograd on the CPU: none there)
    with (
        torch.device(device) if device == "meta" else contextlib.nullcontext(),
        _AsOnCpu() if device == "meta" else contextlib.nullcontext(),
    ):
        for part, mode in zip(parts, config.memory.recompute_of(len(parts))):
            options = stage_options(
                config.model,
                part,
                batch_size=config.data.batch_size,
                recompute=mode,
                device=device,
                precision=config.training.precision,
                optimizer_factory=_no_optimizer,
                compress=config.memory.compress_activations is not None,
                tensor_parallel=_measuring(config),
            )
            worker = StageWorker.from_stage(build_stage(options, (*STEPS, _meta_meter) if device == "meta" else STEPS))
            out = worker.forward(0, x, target if worker.is_last else None)
            held, during, stash = worker.activation_bytes(), {"B": 0, "I": 0}, 0
            for k, op in enumerate(backwards):
                if k:  # each backward takes its own F
                    out = worker.forward(0, x, target if worker.is_last else None)
                worker.reset_peak()
                gradient = None if worker.is_last else _gradient(out)
                worker.backward_input(0, gradient) if op == "I" else worker.backward(0, gradient)
                during[op] = max(0, worker.peak_activation_bytes() - held)
                if op == "I":
                    stash = worker.activation_bytes()
                    worker.backward_weight(0)
            found.append(PartMemory(held, stash, during["B"], during["I"], worker.weight_bytes()))
            x = out
    return found


def _measuring(config: TrainConfig) -> TensorParallel | None:
    """One process of a tensor-parallel group, its collectives left out: what it holds (shards, its
    activations), counted without its peers."""
    n = config.parallel.tensor_parallel
    return None if n == 1 else TensorParallel(MEASURING, 0, n, sequence_parallel=config.parallel.sequence_parallel)


def _no_optimizer(params: Any) -> Any:
    """No optimizer: nothing is updated here (and building one imports torch's compiler, seconds)."""
    return None


def _sample(config: TrainConfig, size: int, device: str) -> tuple[Boundary, Boundary]:
    """A microbatch of ``size`` samples shaped as the model's data (a custom model's own first samples on the CPU).

    Under context parallelism a rank's slice of the sequence (``--seq-len / C`` tokens): its attention over them
    keeps what ring attention keeps (queries, keys, values, output and log-sum-exp of the slice)."""
    spec = config.model
    if spec.kind != "custom":
        seq = spec.seq_len // config.parallel.context_parallel
        shape, dtype = ((size, spec.hidden), torch.float32) if spec.kind == "mlp" else ((size, seq), torch.long)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    inputs, targets = data_source(spec, batch_size=min(size, 2), seed=config.data.data_seed).batch(0)

    def shaped(t: torch.Tensor) -> torch.Tensor:
        return torch.empty((size, *t.shape[1:]), dtype=t.dtype, device=device) if device == "meta" else t

    return boundary.apply(shaped, inputs), boundary.apply(shaped, targets)


def _gradient(out: Boundary) -> Boundary:
    """A gradient for a stage's output: one tensor, or one per floating-point tensor of a tuple."""
    if isinstance(out, torch.Tensor):
        return torch.ones_like(out)
    return tuple(torch.ones_like(t) for t in boundary.differentiable(out))


def _meta_meter(stage: Stage, options: StageOptions) -> None:
    """A build step on the meta device: the activation meter tells storages apart by identity."""
    stage.meter = _MetaMeter({int(p.untyped_storage()._cdata) for p in stage.module.parameters()})


class _MetaMeter(ActivationMeter):
    """``ActivationMeter`` for meta tensors, which have no data pointer: storages told apart by their identity."""

    def key_of(self, storage: torch.UntypedStorage) -> int:
        return int(storage._cdata)


class _AsOnCpu(TorchFunctionMode):
    """Meta tensors computed as the CPU computes, where the meta device would differ in what is kept.

    - random initialisation is skipped: a meta tensor has no values (and
      torch's meta random ops import its compiler, seconds);
    - the losses CPU autocast computes in float32 are cast so
      (``_FLOAT32_UNDER_AUTOCAST``: meta tensors have no autocast);
    - ``scaled_dot_product_attention`` takes the CPU's fused kernel where the
      CPU would choose it (``torch._fused_sdp_choice`` on one-token stand-ins):
      on the meta device the dispatcher takes the unfused path, which keeps the
      attention matrix (batch x heads x seq^2) for the backward; the flash
      kernel keeps only q, k, v, the output and a log-sum-exp.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _INITIALISERS and args and args[0].device.type == "meta":
            return args[0]
        if func in _FLOAT32_UNDER_AUTOCAST and torch.is_autocast_enabled("cpu"):
            args = [_float32(a) for a in args]  # as CPU autocast computes them (meta tensors have no autocast)
        if func is F.scaled_dot_product_attention and len(args) >= 3 and args[0].device.type == "meta":
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            options = {**dict(zip(names, args[3:])), **kwargs}
            plain = options.get("attn_mask") is None and not options.get("dropout_p") and not options.get("enable_gqa")
            causal, scale = bool(options.get("is_causal", False)), options.get("scale")
            q, k, v = args[:3]
            sq, sk, sv = (
                torch.empty(1, *t.shape[1:-2], 1, t.shape[-1], dtype=t.dtype, device="cpu") for t in (q, k, v)
            )
            if plain and torch._fused_sdp_choice(sq, sk, sv, is_causal=causal, scale=scale) == _FLASH:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, is_causal=causal, scale=scale
                )[0]
        return func(*args, **kwargs)


_FLASH = 1  # torch's SDPBackend.FLASH_ATTENTION, as _fused_sdp_choice returns it
_INITIALISERS = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
    torch.Tensor.geometric_,
}
_FLOAT32_UNDER_AUTOCAST = {
    F.cross_entropy,
    F.nll_loss,
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.kl_div,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.log_softmax,
}
"""The losses CPU autocast computes in float32 (its fp32 policy), cast so on meta tensors too."""


def _float32(value: Any) -> Any:
    """A low-precision floating meta tensor in float32, as autocast casts it; anything else as it is."""
    if (
        isinstance(value, torch.Tensor)
        and value.device.type == "meta"
        and value.dtype in (torch.bfloat16, torch.float16)
    ):
        return value.float()
    return value
