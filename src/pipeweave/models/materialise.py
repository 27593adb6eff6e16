"""Models built on the meta device, each rank materialising only its own parts' tensors.

A model that ``pipeweave.pipeline`` cuts (an ``hf:`` model, a module built
under ``torch.device("meta")``) is built without memory first: its
parameters live on the meta device (shapes only) while its buffers --
rotary tables, masks, functions of the config -- are computed as written
(``meta_parameters``, as accelerate's ``init_empty_weights`` keeps them), and
it is traced and cut on fake tensors (``on_fake``). A rank then builds each of its layers
by ``materialise``: a copy of the part whose tensors are read from pretrained
files, or initialised by the module's own init function (transformers'
``_init_weights``, torch's ``reset_parameters``) run on the modules that hold
them and on their ancestors, children first, as ``transformers``'
``initialize_weights`` and ``nn.Module.apply`` run it. The other tensors of
the model stay on the meta device while the init runs: writing to them is a
no-op, so a part costs its own bytes and not the model's.

A layer that a rank splits over its tensor-parallel group is split first, on
the meta device (``Cut``), and then materialised: each split tensor is read as
its rank's slice alone (``Slice``) -- from the files, only those rows or
columns (safetensors' ``get_slice``); initialised, the whole tensor of one
module at a time, its slice kept -- so a rank never holds the whole layer and
its shard is exactly the whole tensor's slice, for any N.

What makes a part's weights independent of which other parts are
materialised beside it -- so that any D, N or P, and plain training,
start from one set of weights -- is the seeding rule: before every random
draw into a tensor (``normal_``, ``uniform_``, ...: what every init
function comes down to), torch's generator is seeded from ``(seed, the
tensor's name in the whole model)`` (``tensor_seed``); before each module's
init, from ``(seed, the module's name)``, for draws into temporaries. A tied
parameter goes by its first name. Megatron-LM and torchtitan seed per rank
and pipeline stage instead, which makes the weights depend on the grid.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from pipeweave.errors import UserError

Init = Callable[[nn.Module], None]
"""A module's own initialisation of its tensors (``reset_parameters``, transformers' ``_init_weights``)."""

Slice = tuple[int, torch.Tensor]
"""A rank's shard of a whole tensor: along a dimension, the indices of the whole it holds (int64)."""

Read = Callable[[list[str], Mapping[str, Slice]], Mapping[str, Any]]
"""``read(names, slices)``: the whole model's tensors ``names``; those in ``slices`` as that slice alone."""


@dataclass(frozen=True)
class Cut:
    """How a rank cuts a layer before its tensors are read (``materialise``).

    ``split`` turns the layer on the meta device into this rank's (its tensor-parallel shards, on the meta
    device too); ``slice_of`` gives, for a tensor of the split layer, the slice of the whole tensor it holds
    (None: it is whole).
    """

    split: Callable[[nn.Module], nn.Module]
    slice_of: Callable[[torch.Tensor], Slice | None]


_DRAWS = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"}
"""The in-place random fills every init function comes down to (``trunc_normal_`` and ``kaiming_uniform_`` too)."""


def tensor_seed(seed: int, name: str) -> int:
    """The seed of the draws into the tensor (or module) ``name`` of a model seeded by ``seed`` (63 bits).

    Example:
        >>> tensor_seed(0, "lm_head.weight") == tensor_seed(0, "lm_head.weight") != tensor_seed(1, "lm_head.weight")
        True
    """
    digest = hashlib.blake2b(struct.pack("<q", seed) + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reset_parameters(module: nn.Module) -> None:
    """torch's convention for a module's own initialisation: its ``reset_parameters()``, where it has one."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is on the meta device (it must be materialised before use)."""
    return any(p.is_meta for p in module.parameters())


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside, every parameter a module registers goes to the meta device; buffers stay as computed.

    A parameter is created where its module creates it (``torch.empty``: pages never touched, so no resident
    memory) and moved to the meta device as it is registered; init code in constructors then writes nothing.

    Example:
        >>> with meta_parameters():
        ...     norm = nn.BatchNorm1d(4)
        >>> norm.weight.is_meta, norm.running_var.is_meta
        (True, False)
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class _SeedPerTensor(TorchFunctionMode):
    """Seeds torch's CPU generator from ``(seed, name)`` before each random fill of a named tensor.

    A function mode, not a dispatch mode: entering a dispatch mode imports torch's compiler stack (about 90 MB
    resident), which a rank building an ``nn.Sequential`` would otherwise never load.
    """

    def __init__(self, seed: int, names: Mapping[int, str]) -> None:
        super().__init__()
        self.seed, self.names = seed, names

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init's functions pass it by name
        if getattr(func, "__name__", None) in _DRAWS and isinstance(target, torch.Tensor) and not target.is_meta:
            name = self.names.get(target.untyped_storage().data_ptr())
            if name is not None:
                torch.manual_seed(tensor_seed(self.seed, name))
        return func(*args, **kwargs)


def _first_names(module: nn.Module) -> dict[int, str]:
    """Each parameter and buffer object of ``module`` by the first name it goes by (a tied one has several)."""
    first: dict[int, str] = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        first.setdefault(id(tensor), name)
    return first


def _holders(module: nn.Module, wanted: set[int]) -> list[tuple[str, nn.Module]]:
    """The submodules holding one of the ``wanted`` tensor objects directly (every holder of a tied one)."""
    return [
        (name, m)
        for name, m in module.named_modules(remove_duplicate=False)
        if any(id(t) in wanted for t in [*m._parameters.values(), *m._buffers.values()] if t is not None)
    ]


def _post_order(module: nn.Module, keep: set[str], prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The submodules named in ``keep``, children before their parents (``nn.Module.apply``'s order)."""
    for name, child in module.named_children():
        yield from _post_order(child, keep, f"{prefix}{name}.")
    if prefix.rstrip(".") in keep:
        yield prefix.rstrip("."), module


def initialised(
    whole: nn.Module,
    names: Iterable[str],
    *,
    seed: int,
    init: Init,
) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the meta-built ``whole`` model, initialised by ``init`` under the seeding rule.

    Only the modules holding them (and their ancestors, whose init may write into a child's tensors, as
    GPT-2's scales its residual projections) are run; everything else stays on the meta device.

    Args:
        whole: the model, parameters on the meta device (not changed: a copy is materialised).
        names: names of its parameters and buffers.
        seed: the model's seed.
        init: a module's own initialisation (``reset_parameters``, transformers' ``_init_weights``).

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        >>> part = initialised(net, ["1.weight"], seed=0, init=reset_parameters)
        >>> whole = initialised(net, ["0.weight", "0.bias", "1.weight", "1.bias"], seed=0, init=reset_parameters)
        >>> bool(torch.equal(part["1.weight"], whole["1.weight"]))
        True
    """
    whole = copy.deepcopy(whole)  # meta tensors: no memory; the caller's model stays as it is
    objects = dict(whole.named_parameters(remove_duplicate=False)) | dict(whole.named_buffers(remove_duplicate=False))
    first = _first_names(whole)
    wanted = {id(objects[n]) for n in names}
    real: dict[int, torch.Tensor] = {}
    holders = _holders(whole, wanted)
    for _, module in holders:  # every direct tensor of a holder: its init draws them all, in order
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None:
                    table[key] = real.setdefault(id(t), _empty_like(t))
    keep = {name for name, _ in holders}
    keep |= {".".join(name.split(".")[:k]) for name in keep for k in range(name.count(".") + 1)} | {""}
    by_storage = {t.untyped_storage().data_ptr(): first[key] for key, t in real.items()}
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _SeedPerTensor(seed, by_storage):
        for name, module in _post_order(whole, keep):
            torch.manual_seed(tensor_seed(seed, name))
            init(module)
    return {n: real[id(objects[n])] for n in names}


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor for ``t`` (a parameter stays a parameter): ``t``'s value where it has one (a buffer computed at
    construction), else uninitialised."""
    data = torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t.detach().clone()
    return nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data


class Initialiser:
    """``read`` for ``materialise``: the tensors of a meta-built model initialised by its own init (``initialised``).

    ``seed`` None: torch's initial seed where a layer is built (``models.custom.build_layer`` seeds it from
    ``--seed`` and the layer's index).
    """

    def __init__(self, whole: nn.Module, *, param_init: Init | None = None, seed: int | None = None) -> None:
        self.whole, self.init, self.seed = whole, param_init or reset_parameters, seed
        self.names = [n for n, _ in whole.named_parameters(remove_duplicate=False)]
        self.names += [n for n, _ in whole.named_buffers(remove_duplicate=False)]

    def __call__(self, names: list[str], slices: Mapping[str, Slice] | None = None) -> dict[str, torch.Tensor]:
        """The tensors ``names``; those in ``slices`` as their slice of the whole tensor, initialised one module
        at a time (its whole tensors, then the slices kept: the same values whatever the split)."""
        seed = self.seed if self.seed is not None else torch.initial_seed()
        if not slices:
            return initialised(self.whole, names, seed=seed, init=self.init)
        by_module: dict[str, list[str]] = {}
        for name in names:
            by_module.setdefault(name.rpartition(".")[0], []).append(name)
        values: dict[str, torch.Tensor] = {}
        for group in by_module.values():  # a module's init draws all its tensors: each module's run once
            whole = initialised(self.whole, group, seed=seed, init=self.init)
            with torch.no_grad():
                values |= {n: whole[n].index_select(*slices[n]) if n in slices else whole[n] for n in group}
            del whole
        return values


@contextlib.contextmanager
def on_fake(module: nn.Module) -> Iterator[FakeTensorMode]:
    """Inside, ``module``'s parameters and buffers are fake tensors on the CPU (shapes, no memory: what a trace
    needs); restored after. Fake rather than meta: a forward that asks its device (transformers' mixtures of
    experts take another path off the CPU) is traced as it runs on the CPU."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    saved = [
        (table, key, t) for m in module.modules() for table in (m._parameters, m._buffers) for key, t in table.items()
    ]
    for table, key, t in saved:
        if t is not None:
            table[key] = fakes.setdefault(id(t), _fake(mode, t))
    try:
        yield mode
    finally:
        for table, key, t in saved:
            table[key] = t


def _fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        with mode:
            fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    else:
        fake = mode.from_tensor(t)
    return nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake


def traced_to_meta(part: fx.GraphModule, meta: dict[int, torch.Tensor]) -> fx.GraphModule:
    """A part cut from a graph traced on fake tensors (``on_fake``), its tensors made meta tensors and its graph's
    devices read from its input (``on_input_device``). ``meta``, shared by the parts of one graph, keeps a tensor
    that several parts hold one object (a tied embedding and head: ``models.pipeline.shared_parameters``)."""
    for m in part.modules():
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if isinstance(t, FakeTensor):
                    table[key] = meta.setdefault(id(t), _on_meta(t))
    return on_input_device(part)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    data = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data


def on_input_device(part: fx.GraphModule) -> fx.GraphModule:
    """``part`` (traced on fake CPU tensors) with every CPU device its graph names -- tensors its forward makes
    from shapes alone: positions, masks -- read from its first input instead, so it runs where it is placed (the
    graphs nested in it too: export's ``wrap_with_autocast`` bodies)."""
    for module in part.modules():
        if isinstance(module, fx.GraphModule):
            _read_device_from_input(module)
    return part


def _read_device_from_input(part: fx.GraphModule) -> None:
    graph = part.graph
    first = next((n for n in graph.nodes if n.op == "placeholder"), None)
    uses = [n for n in graph.nodes if _traced_device_in((n.args, n.kwargs))]
    if first is None or not uses:
        return
    with graph.inserting_after(first):
        device = graph.call_function(getattr, (first, "device"))

    def swap(value: Any) -> Any:
        return device if _is_traced_device(value) else value

    for node in uses:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    part.recompile()


def _is_traced_device(value: Any) -> bool:
    return isinstance(value, torch.device) and value.type in ("cpu", "meta")


def _traced_device_in(value: Any) -> bool:
    found: list[bool] = []
    fx.node.map_aggregate(value, lambda v: found.append(_is_traced_device(v)))
    return any(found)


class MetaLayer(functools.partial):  # type: ignore[type-arg]
    """A layer builder ``MetaLayer(materialise, part, names, read)``: called, the part materialised; called with
    ``cut=`` (``Cut``), split first and only its rank's slices read (``models.custom.build_layer``)."""


def materialise(part: nn.Module, whole_names: Iterable[str], read: Read, cut: Cut | None = None) -> nn.Module:
    """A copy of the meta ``part`` (its tensors named as in the whole model) with every tensor read by ``read``.

    ``read(names, slices)`` gives the values of the whole model's tensors ``names`` (``Initialiser``, or a
    pretrained folder's files); a tensor the part holds under several names (a tied one, pipeweave's deferrable
    linears' aliases) is read once, under the first of them the whole model knows. ``cut``: the copy is split
    first (on the meta device) and each tensor it splits is read as its slice alone. Under
    ``torch.device("meta")`` (what counts a part's bytes) nothing is read: the copy stays on the meta device.

    Raises:
        UserError: a tensor of the part on the meta device that the whole model does not name (a constant
            the trace made of a tensor the forward builds from nothing).
    """
    part = copy.deepcopy(part)
    if cut is not None:
        part = cut.split(part)
    known = set(whole_names)
    name_of: dict[int, str] = {}
    for name, t in [*part.named_parameters(remove_duplicate=False), *part.named_buffers(remove_duplicate=False)]:
        if name in known:
            name_of.setdefault(id(t), name)
    left = [n for n, t in [*part.named_parameters(), *part.named_buffers()] if t.is_meta and id(t) not in name_of]
    if left:
        raise UserError(
            f"{left[0]} of a part is on the meta device and the model names no such tensor; build the module's "
            "tensors in its constructor (a tensor made in forward from no input is traced as a constant)"
        )
    if torch.empty(0).is_meta:  # counting bytes under torch.device("meta"): shapes are all it needs
        return part
    cuts = {} if cut is None else {i: cut.slice_of(t) for i, t in _tensors(part) if i in name_of}
    slices = {name_of[i]: s for i, s in cuts.items() if s is not None}
    values = read(sorted(set(name_of.values())), slices)
    done: dict[int, torch.Tensor] = {}
    for module in part.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None and id(t) in name_of:
                    if id(t) not in done:
                        done[id(t)] = _as(t, values[name_of[id(t)]])
                    table[key] = done[id(t)]
    return part


def _tensors(part: nn.Module) -> Iterator[tuple[int, torch.Tensor]]:
    """Each tensor object ``part`` holds by a name, once, by its id."""
    seen = {
        id(t): t
        for _, t in [*part.named_parameters(remove_duplicate=False), *part.named_buffers(remove_duplicate=False)]
    }
    return iter(seen.items())


def _as(like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in ``like``'s dtype and shape, a Parameter where ``like`` is one, with what was set on ``like``
    (a tensor-parallel shard's ``Split``).

    Raises:
        UserError: a value of another shape (a slice read unlike the shard it fills).
    """
    if value.shape != like.shape:
        raise UserError(
            f"a tensor of shape {list(value.shape)} was read for one of {list(like.shape)}; give weights of the "
            "model's config"
        )
    value = value.to(like.dtype) if value.dtype != like.dtype else value
    if not isinstance(like, nn.Parameter):
        return value
    param = nn.Parameter(value, requires_grad=like.requires_grad)
    param.__dict__.update(like.__dict__)
    return param
