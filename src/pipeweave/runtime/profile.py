"""The profiler: per-layer F, I and W time, activation and parameter bytes, measured where the run runs.

Each layer is run alone as a one-layer ``StageWorker`` (the same code the
executors drive, with its saved-tensor accounting), fed with the previous
layer's output, so what is measured is what a stage of the run does:

- ``forward``, ``input_grad`` (I, weight gradients deferred), ``weight_grad``
  (W): the median of ``repeats`` timed runs after ``warmup`` untimed ones;
- ``activation``: bytes the layer keeps for its backward (saved-tensor hooks),
  its output excluded; ``output``: bytes of that output;
- ``params``: parameter bytes;
- ``flops``: the floating-point operations of F, I and W together
  (``torch.utils.flop_counter``: matrix products and convolutions, the
  element-wise kernels not counted), from one more, untimed, microbatch.
- ``selective_forward``: time of the layer's selective region within F (forward hooks on the
  submodules ``models.build.selective_plan`` names: the gpt's attention core), what
  ``--recompute selective`` replays; ``selective_activation``: ``activation`` of the layer
  run under selective recomputation (0 and ``activation`` for a model that names no region).

The last layer's forward includes the loss, as on the last stage. The host
allocator is set as in every rank (``process.keep_freed_host_memory``): a
large layer's tensors cost page faults without it, which the run does not
pay. Results are
cached as JSON under ``cache_dir`` (default ``$PIPEWEAVE_CACHE`` or
``~/.cache/pipeweave``), keyed by the model spec, the microbatch shape, the
device, the thread count and the torch version.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeweave.errors import UserError
from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary, num_samples, tensors
from pipeweave.models.build import selective_plan
from pipeweave.models.custom import fingerprint
from pipeweave.models.precision import check as precision_check
from pipeweave.models.spec import ModelSpec
from pipeweave.partition.problem import LayerCosts
from pipeweave.runtime.process import keep_freed_host_memory
from pipeweave.runtime.stage.worker import StageWorker


def default_cache_dir() -> Path:
    return Path(os.environ.get("PIPEWEAVE_CACHE", Path.home() / ".cache" / "pipeweave")) / "profiles"


def sample_input(spec: ModelSpec, microbatch_size: int, generator: torch.Generator) -> tuple[Boundary, Boundary]:
    """A random microbatch of the model's data shape: ``(inputs, targets)``."""
    b = microbatch_size
    if spec.kind == "custom":  # the dataset's first samples (profiling needs shapes and types, not randomness)
        from pipeweave.data import data_source

        del generator
        return data_source(spec, batch_size=b).batch(0)
    if spec.kind == "mlp":
        return torch.randn(b, spec.hidden, generator=generator), torch.randn(b, spec.hidden, generator=generator)
    tokens = torch.randint(0, spec.vocab, (b, spec.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def cache_key(spec: ModelSpec, microbatch_size: int, device: torch.device, precision: str = "fp32") -> dict[str, Any]:
    """What a profile depends on; its hash names the cache file."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "spec": asdict(spec),
        "source": fingerprint(spec.entry) if spec.entry else None,  # a custom model's code
        "microbatch_size": microbatch_size,
        "device": str(device.type),
        "device_name": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "host_memory": "kept",
        "precision": precision,
        "counted": "flops",
        "selective": 1,  # profiles before these fields are measured again
    }


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], tuple[float, Any]]:
    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, result

    return timed


def _never_steps(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The profiled worker's optimizer, which only clears gradients (a layer without parameters gets the
    worker's placeholder)."""
    return torch.optim.SGD(params, lr=0.0)


def _profile_layer(
    spec: ModelSpec,
    index: int,
    x: Boundary,
    target: Boundary,
    *,
    warmup: int,
    repeats: int,
    device: torch.device,
    precision: str,
) -> tuple[dict[str, Any], Boundary]:
    """Costs of layer ``index`` on input ``x``; returns them and the layer's output."""
    worker = StageWorker(
        spec, [index], batch_size=num_samples(x), device=device, precision=precision, optimizer_factory=_never_steps
    )
    layer = worker.module[str(index)]
    timed = _timer(device)
    times: dict[str, list[float]] = {"forward": [], "input_grad": [], "weight_grad": [], "selective_forward": []}
    with FlopCounterMode(display=False) as counter:  # one untimed microbatch, its operations counted
        _microbatch(worker, warmup + repeats, x, target, timed)
    region = _RegionClock(_selective_modules(spec, index, layer), device)
    out = x
    for mb in range(warmup + repeats):
        worker.reset_peak()
        held_before = worker.activation_bytes()
        region.total = 0.0
        f, i, w, out = _microbatch(worker, mb, x, target, timed)
        s = region.total
        kept = worker.peak_activation_bytes() - held_before
        if mb >= warmup:
            for key, value in zip(times, (f, i, w, s)):
                times[key].append(value)
    region.remove()
    output_bytes = sum(t.untyped_storage().nbytes() for t in tensors(out))
    costs = {key: statistics.median(values) for key, values in times.items()}
    activation = max(0, kept - output_bytes)
    costs.update(
        name=f"layers.{index}",
        type=type(layer).__name__,
        params=worker.weight_bytes(),
        activation=activation,
        output=output_bytes,
        flops=float(counter.get_total_flops()),
        selective_activation=_selective_kept(spec, index, x, target, device, precision) - output_bytes
        if region.modules
        else activation,
    )
    return costs, boundary.apply(torch.Tensor.detach, out)


def _microbatch(
    worker: StageWorker, mb: int, x: Boundary, target: Boundary, timed: Callable[[Callable[[], Any]], tuple[float, Any]]
) -> tuple[float, float, float, Boundary]:
    """One microbatch's F, I and W through ``worker``, each timed: ``(f, i, w, output)``."""
    f, out = timed(lambda: worker.forward(mb, x, target if worker.is_last else None))
    grad = None if worker.is_last else _gradient_like(out)
    i, _ = timed(lambda: worker.backward_input(mb, grad))
    w, _ = timed(lambda: worker.backward_weight(mb))
    worker.optimizer.zero_grad(set_to_none=True)
    return f, i, w, out


def _selective_modules(spec: ModelSpec, index: int, layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules of the layer that selective recomputation replays (none if the model names no region)."""
    try:
        return [layer.get_submodule(name) for name in selective_plan(spec, index, layer)]
    except (UserError, AttributeError):
        return []


class _RegionClock:
    """Seconds spent in some submodules' forwards (hooks before and after each), summed in ``total``."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device) -> None:
        self.modules, self.device, self.total, self._start = modules, device, 0.0, 0.0
        self.handles = [
            h for m in modules for h in (m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._exit))
        ]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _enter(self, *_: Any) -> None:
        self._start = self._now()

    def _exit(self, *_: Any) -> None:
        self.total += self._now() - self._start

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _selective_kept(
    spec: ModelSpec, index: int, x: Boundary, target: Boundary, device: torch.device, precision: str
) -> int:
    """Bytes one microbatch keeps in the layer under selective recomputation, its output included."""
    worker = StageWorker(
        spec, [index], batch_size=num_samples(x), device=device, precision=precision, recompute="selective"
    )
    worker.forward(0, x, target if worker.is_last else None)
    return worker.activation_bytes()


def _gradient_like(out: Boundary) -> Boundary:
    """A random gradient for a stage output: one tensor, or one per floating-point tensor of a tuple."""
    if isinstance(out, torch.Tensor):
        return torch.randn_like(out)
    return tuple(torch.randn_like(t) for t in boundary.differentiable(out))


def profile_model(
    spec: ModelSpec,
    microbatch_size: int,
    *,
    device: torch.device | str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    cache_dir: Path | str | None = None,
    refresh: bool = False,
    precision: str = "fp32",
) -> LayerCosts:
    """Per-layer costs of one microbatch of ``spec`` on ``device`` (cached).

    Args:
        spec: the model.
        microbatch_size: samples per microbatch (the run's batch size / microbatches).
        device: where to measure: the device the run uses.
        warmup, repeats: untimed and timed runs per layer (the median is kept).
        cache_dir: where profiles are kept (None: ``$PIPEWEAVE_CACHE`` or ``~/.cache/pipeweave``).
        refresh: measure again even if a cached profile exists.
        precision: ``fp32`` or ``bf16``, as the run computes (``models.precision``).

    Raises:
        UserError: microbatch_size or repeats < 1.

    Example:
        >>> costs = profile_model(ModelSpec(kind="mlp", layers=2, hidden=8), 4, repeats=1, cache_dir="/tmp/pw")
        >>> costs.num_layers, costs.params[0] == (8 * 32 + 32 + 32 * 8 + 8 + 2 * 8) * 4
        (2, True)
    """
    if microbatch_size < 1 or repeats < 1 or warmup < 0:
        raise UserError(
            f"microbatch_size={microbatch_size}, repeats={repeats}, warmup={warmup}: give sizes and repeats >= 1"
        )
    device = torch.device(device)
    keep_freed_host_memory()  # as every rank runs (launch.LaunchOptions.keep_host_memory)
    key = cache_key(spec, microbatch_size, device, precision_check(precision))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"{digest}.json" if cache_dir is not None else default_cache_dir() / f"{digest}.json"
    if path.exists() and not refresh:
        return LayerCosts.load(path)
    generator = torch.Generator().manual_seed(spec.seed)
    x, target = (boundary.to(part, device) for part in sample_input(spec, microbatch_size, generator))
    rows = []
    for index in range(spec.num_layers):
        row, x = _profile_layer(
            spec, index, x, target, warmup=warmup, repeats=repeats, device=device, precision=precision
        )
        rows.append(row)
    costs = LayerCosts(
        **{
            field: [row[field] for row in rows]
            for field in (
                "forward",
                "input_grad",
                "weight_grad",
                "activation",
                "params",
                "output",
                "flops",
                "selective_forward",
                "selective_activation",
            )
        },
        names=[row["name"] for row in rows],
        types=[row["type"] for row in rows],
        meta=key,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    costs.save(tmp)
    tmp.replace(path)  # atomic: concurrent ranks never read a half-written profile
    return costs
