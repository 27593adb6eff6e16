"""``pipeweave.pipeline``: your module as written, split into pipeweave's layers (a ``LayerModel``).

Three ways in, the cheapest that serves the module:

- an ``nn.Sequential`` needs no tracing: its children are the layers (split
  points, if given, group them: ``"4"`` starts a layer at child 4);
- any other module is traced once by ``torch.export`` (non-strict: its Python
  runs as written, loops over blocks and Hugging Face models included; where
  export cannot, by ``torch.fx`` with the blocks kept whole: ``models.tracing``)
  and cut at ``split_points``, module names as torch.distributed.pipelining's
  ``SplitPoint.BEGINNING`` takes them (``models.graph_split``);
- without split points, the cut falls before every block of the module's
  ``nn.ModuleList`` s: many small layers that pipeweave's partitioner groups
  into D balanced parts (``--partition time`` by the profiler, or ``uniform``).

What a layer list needs besides the layers -- a loss and a dataset -- is
asked for as ``LayerModel`` asks for it. The layers hold the module's own
Parameter objects; each rank (and each in-process stage) builds its layers
as a copy of its parts, the parameters a part shares with another (tied
embeddings) found and kept as one group (``models.tied``)::

    net = MyTransformer()
    model = pipeweave.pipeline(net, (tokens[:2],), ["blocks.2"], loss=my_loss, dataset=data)

A module whose parameters are on the meta device (built inside
``models.materialise.meta_parameters()``, or ``torch.device("meta")``) is
traced and cut on fake tensors, holding no memory; each rank then
materialises only its own layers, initialised by the module's own init
(``param_init``; by default each submodule's ``reset_parameters``) under a
seed per tensor name, so a part's weights are the whole model's, whatever
the split (``models.materialise``)::

    with pipeweave.models.materialise.meta_parameters():
        net = MyTransformer()
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipeweave.errors import UserError
from pipeweave.models.custom import LayerModel, entry_module, load_model
from pipeweave.models.graph_split import check_split_points, cuts, first_calls, opening, split_graph
from pipeweave.models.materialise import Init, Initialiser, MetaLayer, is_meta, materialise, on_fake, traced_to_meta
from pipeweave.models.tp_patterns import layer_plans
from pipeweave.models.tracing import trace


def pipeline(
    module: nn.Module,
    example_inputs: Any = None,
    split_points: Sequence[str] | None = None,
    *,
    loss: Callable[[Any, Any], torch.Tensor],
    dataset: Any,
    eval_dataset: Any = None,
    param_init: Init | None = None,
    seed: int | None = None,
    tp_plan: Mapping[str, Any] | None = None,
) -> LayerModel:
    """``module`` as a ``LayerModel``: cut at ``split_points`` (module names), its parameters shared.

    Args:
        module: the model as written; its forward takes the dataset's inputs (one tensor, or a tuple as
            several arguments) and returns what ``loss`` takes with the targets.
        example_inputs: a microbatch of inputs (a tensor or a tuple) to trace with; default: two samples
            of ``dataset``. The batch dimension, and the next (a sequence's length), are traced as dynamic
            where the module allows.
        split_points: module names, each starting a new layer; None: before every block of the module's
            ``nn.ModuleList`` s (an ``nn.Sequential``: every child).
        loss, dataset, eval_dataset: as ``LayerModel``'s.
        param_init: for a module on the meta device, a submodule's own initialisation of its tensors (default:
            its ``reset_parameters``, where it has one), run as each rank materialises its layers.
        seed: for a module on the meta device, the seed of its tensors' draws (``models.materialise``);
            None: each layer's seed (``--seed`` and the layer's index).
        tp_plan: for ``--tensor-parallel N``: the module's linear layers to split, by name pattern and style,
            as torch's ``parallelize_module`` takes them: ``{"layers.*.attn.q": "colwise", "layers.*.attn.o":
            "rowwise"}`` (``models.tp_patterns``). The module's code must run on a share of the heads: sizes
            it reads from its tensors, or writes as literals in the traced graph (``models.graph_shard``).

    Raises:
        UserError: split points that are no list of strings, that name no module, that are out of the order
            the forward runs them or start where it starts (cutting nothing); a module neither
            ``torch.export`` nor ``torch.fx`` can trace; a ``tp_plan`` entry that names no linear layer.

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 4))
        >>> m = pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), split_points=["2"],
        ...              loss=nn.functional.mse_loss, dataset=data)
        >>> len(m.layers)
        2
    """
    if not isinstance(module, nn.Module):
        raise UserError(f"pipeweave.pipeline takes an nn.Module, not {type(module).__name__}")
    points = _names(split_points) if split_points is not None else block_starts(module)
    check_split_points(module, points)
    module.train()
    meta = is_meta(module)
    if isinstance(module, nn.Sequential):
        names = [name for name, _ in module.named_children()]
        parts = _sequential_parts(module, points)
        if split_points is not None:
            _check_order(module, points, {p: names.index(p) for p in points})
        starts = points
    else:
        inputs = example_inputs if example_inputs is not None else _example(dataset)
        leaves = {n for n in {*points, *_blocks(module)} if not any(p.startswith(n + ".") for p in points)}
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        with on_fake(module) if meta else contextlib.nullcontext() as fake:  # traced on fake tensors: no memory
            root = trace(module, tuple(_fake(fake, x) for x in inputs) if fake else inputs, leaves)
        if split_points is not None:  # the automatic cuts may start where the forward does: that one cuts nothing
            start = opening(root.graph, {name for name, _ in module.named_modules()})
            _check_order(module, points, {p: max(0, i - start) for p, i in first_calls(root.graph, points).items()})
        parts, starts = split_graph(root, points), cuts(root.graph, points)
        if meta:
            tensors: dict[int, torch.Tensor] = {}
            parts = [traced_to_meta(part, tensors) for part in parts]
    if meta:
        source = Initialiser(module, param_init=param_init, seed=seed)
        layers = [MetaLayer(materialise, part, source.names, source) for part in parts]
    else:
        layers = [functools.partial(_copy, part) for part in parts]
    return LayerModel(
        layers=layers,
        loss=loss,
        dataset=dataset,
        eval_dataset=eval_dataset,
        tied=shared_parameters(parts),
        split_points=tuple(starts),
        tp_plan=None if tp_plan is None else [plan or None for plan in layer_plans(module, parts, tp_plan)],
    )


def _fake(mode: Any, x: Any) -> Any:
    """An example input as a fake tensor of ``mode`` (shapes only), to trace a meta module with."""
    return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x


def _names(split_points: Any) -> list[str]:
    """``split_points`` as a list of module names, or one line saying what it is instead."""
    if isinstance(split_points, (str, bytes)) or not isinstance(split_points, (list, tuple)):
        raise UserError(
            f"split_points={split_points!r} is a {type(split_points).__name__}, not a list of module names; give "
            "e.g. ['blocks.2'], an int D through pipeweave.pipeline (D parts balanced by the profiler), or None"
        )
    bad = [p for p in split_points if not isinstance(p, str)]
    if bad:
        raise UserError(
            f"split_points={list(split_points)!r} holds {bad[0]!r}, a {type(bad[0]).__name__}; give module "
            "names (strings), e.g. ['blocks.2']"
        )
    return list(split_points)


def _check_order(module: nn.Module, points: list[str], position: dict[str, int]) -> None:
    """Split points given in the order the module runs them, none where its forward starts (it would cut
    nothing); ``position``: where each starts among the module's computations."""
    at_start = [p for p in points if position.get(p) == 0]
    if at_start:
        raise UserError(
            f"split point {at_start[0]!r} is where {type(module).__name__}'s forward starts: it would leave an "
            "empty first layer; drop it"
        )
    ordered = sorted(points, key=position.__getitem__)
    if ordered != points:
        raise UserError(
            f"split points {points} are out of the order the forward runs them; give them in order: {ordered}"
        )


def _copy(part: nn.Module) -> nn.Module:
    """A part's own copy (its Parameters new objects, shared among themselves as in the part)."""
    with warnings.catch_warnings():  # torch's GraphModule copy warns of its own deprecated pytree spec
        warnings.filterwarnings("ignore", "`isinstance\\(treespec, LeafSpec\\)`", FutureWarning)
        return copy.deepcopy(part)


@functools.cache
def from_module(entry: str) -> LayerModel:
    """The plain module ``--model FILE.py:NAME`` names, split by ``pipeline`` with the ``loss`` and ``dataset``
    (optional: ``eval_dataset``, ``split_points``, ``tp_plan``, and ``param_init`` for a module built on the
    meta device) its file defines beside it, as a LayerModel has them.

    Raises:
        UserError: the file lacks the loss or the dataset.
    """
    net, where = load_model(entry), entry_module(entry)
    assert isinstance(net, nn.Module)
    lacking = [name for name in ("loss", "dataset") if not hasattr(where, name)]
    if lacking:
        raise UserError(
            f"--model {entry} is an nn.Module; define {' and '.join(lacking)} beside it in its file "
            "(loss(output, target) -> the mean loss; a dataset of (input, target) pairs), as a "
            "LayerModel has them"
        )
    points = getattr(where, "split_points", None)
    if isinstance(points, int):
        raise UserError(
            f"--model {entry}: split_points = {points} asks for a split balanced by the profiler, which "
            "the command line does by itself: drop split_points and give --partition time"
        )
    return pipeline(
        net,
        None,
        points,
        loss=where.loss,
        dataset=where.dataset,
        eval_dataset=getattr(where, "eval_dataset", None),
        param_init=getattr(where, "param_init", None),
        tp_plan=getattr(where, "tp_plan", None),
    )


def block_starts(module: nn.Module) -> list[str]:
    """Every child of the module's outermost ``nn.ModuleList`` s (what runs before the first is a layer of its
    own: the embedding), or every child of a Sequential but the first."""
    if isinstance(module, nn.Sequential):
        return [name for name, _ in module.named_children()][1:]
    blocks = _blocks(module)
    if not blocks:
        raise UserError(
            f"{type(module).__name__} has no nn.ModuleList of blocks to split before; give split_points (module names)"
        )
    return blocks


def _blocks(module: nn.Module) -> list[str]:
    lists = [name for name, m in module.named_modules() if isinstance(m, nn.ModuleList)]
    outer = [n for n in lists if not any(n.startswith(o + ".") for o in lists if o != n)]
    return [f"{name}.{child}" for name in outer for child, _ in module.get_submodule(name).named_children()]


def _sequential_parts(module: nn.Sequential, points: list[str]) -> list[nn.Module]:
    names = [name for name, _ in module.named_children()]
    starts = sorted(names.index(p) for p in points if p in names)
    if len(starts) != len(points):
        raise UserError(
            f"split points of an nn.Sequential name its children ({', '.join(names[:6])}, ...); "
            f"{[p for p in points if p not in names][0]!r} is not one"
        )
    bounds = [0, *starts, len(names)]
    children = list(module.children())
    # Children keep their names: a layer's "<k>.<child>.<name>" is the module's "<child>.<name>" behind "<k>."
    parts = [nn.Sequential(OrderedDict(zip(names[a:b], children[a:b]))) for a, b in zip(bounds, bounds[1:])]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise UserError(f"split point {names[0]!r} leaves an empty first layer; drop it")
    return parts


def _example(dataset: Any) -> tuple[Any, ...]:
    """Two samples' inputs of ``dataset``, collated (two: a batch of one would be traced as a constant)."""
    inputs = torch.utils.data.default_collate([dataset[k][0] for k in range(min(2, len(dataset)))])
    return tuple(inputs) if isinstance(inputs, list) else (inputs,)


def shared_parameters(parts: Sequence[nn.Module]) -> list[list[str]]:
    """Groups of global names ``"<part>.<name>"`` of each Parameter object that several parts hold."""
    holders: dict[int, list[str]] = {}
    for index, part in enumerate(parts):
        seen: set[int] = set()
        for name, p in part.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                holders.setdefault(id(p), []).append(f"{index}.{name}")
    return [names for names in holders.values() if len(names) > 1]
