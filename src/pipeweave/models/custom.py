"""Your own model: a list of layers, a loss and a dataset, named by ``--model FILE.py:NAME``.

pipeweave cuts a model into consecutive layers (``DESIGN.md``), so a model of
your own is described the way DeepSpeed's pipeline module and
``nn.Sequential`` describe one: a list of layers, each mapping one tensor to
one tensor -- or a tuple of tensors, handed to the next layer as its
arguments (``models.boundary``: hidden states and a mask, say) -- the first
taking the dataset's inputs and the last's output going to the loss with the
targets. Each layer is given as a zero-argument function
that builds it, so every rank builds only the layers of its own stages::

    # my_model.py
    import torch
    from torch import nn
    from pipeweave.models import LayerModel

    def model() -> LayerModel:
        data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
        return LayerModel(
            layers=[lambda: nn.Linear(32, 64), lambda: nn.Sequential(nn.GELU(), nn.Linear(64, 4))],
            loss=nn.functional.cross_entropy,
            dataset=data,
        )

    $ pipeweave train --model my_model.py:model -s zb-h1 --batch 64 --microbatches 4

The entry ``FILE.py:NAME`` or ``package.module:NAME`` names a ``LayerModel``
or a function returning one; every rank loads it again (spawned ranks and
torchrun's alike), so on several nodes the file must be at the same path on
each. Within one process an entry is loaded once.

What pipeweave does with it:

- layer ``k`` is built with torch's global generator seeded by ``(seed, k)``
  (``--seed``), in a forked RNG state: a layer is identical whatever rank
  builds it, so every schedule starts from plain training's weights;
- every ``nn.Linear`` inside a layer is swapped for pipeweave's ``Linear``
  holding the same parameters, so zero-bubble schedules defer its weight
  gradient to ``W`` (``models.layers``); other parameters get their gradients
  from autograd at once, in ``I`` (exact, just not deferred);
- mini-batch ``k`` is ``batch_size`` samples of the dataset drawn in the
  order of a seeded permutation per epoch (``data.dataset``), collated with
  torch's ``default_collate``; the first stage keeps the inputs, the last the
  targets;
- ``loss(output, targets)`` must be the mean over the samples (torch's default
  reduction): each microbatch's loss is scaled by its share of the batch;
- ``eval_dataset``, if given, is what ``--eval-every`` evaluates on (in order,
  no shuffling), the layers in ``eval()`` mode;
- checkpoints keep each part's persistent buffers beside its parameters.

Exactness against plain training holds for dropout too: every layer call
draws from torch's generator reseeded by (seed, step, microbatch, layer)
(``models.randomness``); and for batch norm's outputs and gradients, but the
replicas of a part keep running statistics of their own microbatches only.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary, num_samples, tensors
from pipeweave.models.layers import Linear
from pipeweave.models.materialise import Cut, MetaLayer
from pipeweave.models.tied import check_groups

LayerBuilder = Callable[[], nn.Module]
_FILE_MODULE = "pipeweave_user_"  # prefix of the module names of model files loaded by path
HELD = "held:"
"""Prefix of the entries of models held in this process only (``hold``), e.g. to profile them."""
_HELD: dict[str, LayerModel] = {}


@dataclass(frozen=True, kw_only=True)
class LayerModel:
    """A model as pipeweave trains it: lazily built layers, a mean loss, a map-style dataset.

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
        >>> m = LayerModel(layers=[lambda: nn.Linear(4, 2)], loss=nn.functional.mse_loss, dataset=data)
        >>> len(m.layers)
        1
    """

    layers: Sequence[LayerBuilder]
    """One zero-argument builder per layer, in order; each layer maps a tensor, or a tuple of tensors
    (its arguments), to a tensor or a tuple of tensors, the samples in dimension 0 of each."""
    loss: Callable[[Any, Any], torch.Tensor]
    """``loss(last layer's output, targets)``: the mean over the samples."""
    dataset: Any
    """A map-style dataset (``__len__``, ``__getitem__``) of ``(input, target)`` pairs; an input may be a
    tuple of tensors (the first layer's arguments)."""
    eval_dataset: Any = None
    """Held-out ``(input, target)`` pairs for ``--eval-every`` (optional)."""
    tp_plan: Sequence[Mapping[str, str] | None] | None = None
    """For ``--tensor-parallel N``: per layer, its linear layers to split by name and style, e.g.
    ``{"attn.qkv": "colwise_qkv", "attn.proj": "rowwise"}`` (``models.tensor_parallel``; None: the layer is
    replicated whole). The layer's own code must then work on its rank's share of the features (a
    per-head computation reads its head count from the shard), as torchtitan's ``parallelize`` asks."""
    tied: Sequence[Sequence[str]] = ()
    """Groups of parameters that are one parameter, each by global name ``"<layer>.<name in layer>"``, as
    DeepSpeed's ``TiedLayerSpec`` declares them (``pipeweave.pipeline`` finds them by itself): every member
    starts as the group's first one, and their gradients are summed before each update
    (``models.tied``, ``runtime.stage.tied``). Members must lie in one stage, or in a pipeline's first
    and last stages (an embedding and the head)."""
    split_points: Sequence[str] = ()
    """The module names where layers 1, 2, ... start, when ``pipeweave.pipeline`` cut a module (for the
    record: with ``split_points=D`` it chose them by the profiler)."""
    selective: Sequence[Sequence[str] | None] | None = None
    """For ``--recompute selective``: per layer, the names of its submodules to replay before the backward
    instead of keeping their activations (``torch.utils.checkpoint``), e.g. ``["attn.core"]`` for an
    attention core; None: nothing in that layer. A model without it refuses ``--recompute selective``."""

    def __post_init__(self) -> None:
        if not isinstance(self.layers, Sequence) or not self.layers:
            raise UserError("LayerModel.layers must be a non-empty list of functions that build one layer each")
        for k, build in enumerate(self.layers):
            if not callable(build) or isinstance(build, nn.Module):
                raise UserError(
                    f"LayerModel.layers[{k}] is {type(build).__name__}, not a function; write "
                    f"lambda: <the layer> so that only the rank that holds it builds it"
                )
        if not callable(self.loss):
            raise UserError(f"LayerModel.loss is {type(self.loss).__name__}; give a function (output, target) -> loss")
        if self.tp_plan is not None and (isinstance(self.tp_plan, Mapping) or len(self.tp_plan) != len(self.layers)):
            raise UserError(
                f"LayerModel.tp_plan must be a list with one entry per layer ({len(self.layers)}): a "
                "dict {module name: 'colwise' or 'rowwise'} or None"
            )
        check_groups(self.tied, len(self.layers))
        if self.selective is not None and (
            isinstance(self.selective, (str, Mapping)) or len(self.selective) != len(self.layers)
        ):
            raise UserError(
                f"LayerModel.selective must be a list with one entry per layer ({len(self.layers)}): a "
                "list of submodule names to replay under --recompute selective, or None"
            )
        for name in ("dataset", "eval_dataset"):
            data = getattr(self, name)
            if data is None and name == "eval_dataset":
                continue
            if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
                raise UserError(
                    f"LayerModel.{name} is {type(data).__name__}; give a map-style dataset "
                    "(__len__ and __getitem__ returning (input, target)), e.g. a TensorDataset"
                )
            if len(data) < 1:
                raise UserError(f"LayerModel.{name} is empty; give at least one (input, target) pair")


def is_entry(text: str) -> bool:
    """Whether ``text`` names a model entry (``FILE.py:NAME`` or ``module:NAME``) rather than a built-in model."""
    return ":" in text


@functools.cache
def load_model(entry: str) -> LayerModel | nn.Module:
    """The ``LayerModel`` (or plain ``nn.Module``) that ``entry`` names, loaded once per process.

    Raises:
        UserError: a malformed entry, a missing file or module, a missing name, or not a LayerModel.
    """
    if entry.startswith(HELD):
        if entry not in _HELD:
            raise UserError(f"--model {entry} names a model held by another process; give FILE.py:NAME")
        return _HELD[entry]
    where, sep, name = entry.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise UserError(f"--model {entry!r} is not FILE.py:NAME or module:NAME; write e.g. my_model.py:model")
    module = _module(where, entry)
    if not hasattr(module, name):
        raise UserError(f"--model {entry}: {where} has no {name!r}; name a LayerModel or a function returning one")
    value = getattr(module, name)
    if callable(value) and not isinstance(value, (LayerModel, nn.Module)):
        try:
            with torch.random.fork_rng(devices=[]):  # a module built inside is the same on every rank
                torch.manual_seed(0)
                value = value()
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"--model {entry}: {name}() raised {_where(e)}; fix the model's code") from None
    if isinstance(value, nn.Module):  # split by pipeweave.pipeline (models.pipeline.from_module)
        return value
    if not isinstance(value, LayerModel):
        raise UserError(
            f"--model {entry} gives {type(value).__name__}, not a pipeweave.models.LayerModel; "
            "return LayerModel(layers=..., loss=..., dataset=...) or an nn.Module"
        )
    return value


def entry_module(entry: str) -> Any:
    """The Python module that defines ``entry``'s name (loaded once, as ``load_model`` loads it)."""
    return _module(entry.rpartition(":")[0], entry)


def _module(where: str, entry: str) -> Any:
    if not where.endswith(".py"):
        try:
            return importlib.import_module(where)
        except ImportError as e:
            raise UserError(
                f"--model {entry}: cannot import {where} ({e}); give FILE.py:NAME or an importable module"
            ) from None
    path = Path(where).resolve()
    if not path.is_file():
        raise UserError(f"--model {entry}: no file {where}; give the path of the Python file that defines the model")
    main = sys.modules.get("__main__")  # a model defined in the running script (spawned ranks: its re-import)
    main_file = getattr(main, "__file__", None)
    if main_file and Path(main_file).resolve() == path:
        return main
    module_name = f"{_FILE_MODULE}{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # pickling and dataclasses look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise UserError(f"--model {entry}: loading {where} raised {_where(e)}; fix the file") from None
    return module


def _where(error: BaseException) -> str:
    """``Type: message (file:line)`` of an exception raised in the user's code: one line, the place to look."""
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} ({error.filename}:{error.lineno})"
    libraries = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[1]))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(libraries)]
    place = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""  # the user's line, if any
    return f"{type(error).__name__}: {error}{place}"


def entry_of(factory: Callable[[], LayerModel]) -> str:
    """The entry naming ``factory`` (a module-level function), for ``ModelSpec(kind="custom", entry=...)``.

    A function of the running script is named by its file, so spawned ranks find it.

    Raises:
        UserError: a nested function or lambda, which no other process can load by name.
    """
    name = getattr(factory, "__qualname__", "")
    if not name.isidentifier():
        raise UserError(
            f"{name or factory!r} is not a module-level function; define the model factory at the top "
            "level of a module or script"
        )
    module = sys.modules.get(factory.__module__)
    by_file = factory.__module__ in ("__main__", "__mp_main__") or factory.__module__.startswith(_FILE_MODULE)
    if by_file and getattr(module, "__file__", None):  # the running script, or a file loaded by its path
        return f"{Path(module.__file__).resolve()}:{name}"  # type: ignore[union-attr,arg-type]
    return f"{factory.__module__}:{name}"


def hold(model: LayerModel, digest: str) -> str:
    """An entry ``held:DIGEST`` naming ``model`` in this process only (``ModelSpec(kind="custom", entry=...)``
    then profiles it as any custom model); ``digest`` says what the model is, for the profile cache."""
    entry = f"{HELD}{digest}"
    _HELD[entry] = model
    return entry


def fingerprint(entry: str) -> str:
    """A digest of the source that defines ``entry`` (profile caches must not outlive an edit of it)."""
    if entry.startswith(HELD):
        return entry[len(HELD) :]
    where = entry.rpartition(":")[0]
    if where.endswith(".py"):
        path: str | None = str(Path(where).resolve())
    else:
        spec = importlib.util.find_spec(where)
        path = spec.origin if spec is not None else None
    text = Path(path).read_bytes() if path and Path(path).is_file() else entry.encode()
    return hashlib.sha256(text).hexdigest()[:16]


def build_layer(model: LayerModel, index: int, seed: int, cut: Cut | None = None) -> nn.Module:
    """Layer ``index`` of ``model``, initialised from torch's generator seeded by ``seed``, deferrable Linears.

    ``cut``: the layer split by ``cut.split`` (its tensor-parallel shard); a layer built on the meta device
    (``models.materialise.MetaLayer``) is split before its tensors are read, and reads its slices alone.
    """
    builder = model.layers[index]
    meta = cut is not None and isinstance(builder, MetaLayer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            layer = builder(cut=_deferrable_first(cut)) if meta and cut is not None else builder()
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"building layer {index} of the model raised {_where(e)}; fix its builder") from None
    if not isinstance(layer, nn.Module):
        raise UserError(
            f"layer {index} of the model is {type(layer).__name__}, not a torch.nn.Module; "
            "each builder must return one module"
        )
    layer = deferrable(layer)
    return layer if cut is None or meta else cut.split(layer)


def _deferrable_first(cut: Cut) -> Cut:
    """``cut`` splitting the layer's deferrable Linears (what a plan names), its ``nn.Linear`` made them first."""
    return Cut(lambda layer: cut.split(deferrable(layer)), cut.slice_of)


def deferrable(module: nn.Module) -> nn.Module:
    """``module`` with every ``nn.Linear`` in it replaced by pipeweave's ``Linear`` on the same parameters.

    Only exact ``nn.Linear`` instances: subclasses may be used by their owners
    through their parameters rather than their ``forward``.

    Example:
        >>> seq = deferrable(nn.Sequential(nn.Linear(2, 3), nn.ReLU()))
        >>> isinstance(seq[0], Linear), type(seq[0]) is nn.Linear, tuple(seq[0].weight.shape)
        (True, False, (3, 2))
    """
    if type(module) is nn.Linear:
        return Linear.wrapping(module)
    for name, child in list(module.named_children()):
        replaced = deferrable(child)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def probe(model: LayerModel, seeds: Sequence[int], inputs: Boundary, targets: Boundary) -> int:
    """Run a few samples through every layer and the loss; the largest bytes per sample between two layers.

    What a stage boundary may have to carry (activations forward, their
    gradients back): shared-memory rings are sized from it before any rank
    starts (a tuple's tensors each start at a multiple of 8 bytes in its
    message: 8 bytes per tensor are added). Layers are built one at a time
    (``seeds[k]`` for layer ``k``) and run in ``eval()`` mode without a graph.

    Raises:
        UserError: a layer that does not return a tensor or a tuple of tensors with the samples
            in dimension 0, or a loss that is not a scalar.
    """
    largest = 0
    x: Any = inputs
    samples = num_samples(inputs)
    with torch.no_grad():
        for index, seed in enumerate(seeds):
            layer = build_layer(model, index, seed).eval()
            try:
                x = boundary.call(layer, x)
            except Exception as e:
                given = "the dataset's inputs" if index == 0 else f"the output of layer {index - 1}"
                raise UserError(
                    f"layer {index} of the model fails on {given}: {_where(e)}; check the layer list"
                ) from None
            if not isinstance(x, torch.Tensor) and not (
                isinstance(x, tuple) and x and all(isinstance(t, torch.Tensor) for t in x)
            ):
                raise UserError(
                    f"layer {index} of the model returns {type(x).__name__}; each layer must "
                    "return a tensor or a tuple of tensors (the next layer's arguments)"
                )
            if isinstance(x, tuple) and len(x) > boundary.MAX_TENSORS:
                raise UserError(
                    f"layer {index} of the model returns a tuple of {len(x)} tensors; a stage "
                    f"boundary carries at most {boundary.MAX_TENSORS}: group some of them"
                )
            if index + 1 < len(seeds):  # a boundary: microbatches are split and sent along dimension 0
                for t in tensors(x):
                    if t.dim() == 0 or len(t) != samples:
                        raise UserError(
                            f"layer {index} of the model returns shape {tuple(t.shape)} for "
                            f"{samples} samples; keep the samples in dimension 0 between layers "
                            "(e.g. batch_first=True)"
                        )
                padding = 8 * len(x) if isinstance(x, tuple) else 0
                largest = max(largest, -(-boundary.nbytes(x) // samples) + padding)
        try:
            loss = model.loss(x, targets)
        except Exception as e:
            raise UserError(
                f"the model's loss fails on the last layer's output and the targets: {_where(e)}; "
                "check the loss and the dataset's targets"
            ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise UserError(
            f"the model's loss gives {type(loss).__name__} {getattr(loss, 'shape', '')}; it must "
            "return the mean loss, a floating-point scalar tensor"
        )
    return largest
