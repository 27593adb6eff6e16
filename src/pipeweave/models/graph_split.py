"""Cut a module's traced graph at module boundaries into consecutive parts (``pipeweave.pipeline``).

``torch.export`` (non-strict: the module's Python runs as written, loops
over blocks included; or ``torch.fx`` with the blocks kept whole where
export cannot: ``models.tracing``) records the module's forward as one graph whose
nodes remember the submodule that issued them (``nn_module_stack``). A
split point ``"blocks.2"`` starts a new part at the first node issued inside
``blocks.2``, as torch.distributed.pipelining's ``SplitPoint.BEGINNING``
does. Each part becomes an ``fx.GraphModule`` holding the very Parameter
objects of the module (shared, not copied), taking the values alive at its
start as arguments and returning those alive at its end, so parts chain as
pipeweave's layers do (``models.boundary``).

Values computed from no input and no parameter (a causal mask, rotary
tables, position indices: functions of shapes and buffers) are recomputed
in every part that uses them rather than sent; the batch size and the
sequence length, dynamic in the trace, are read back from a tensor that
does cross, so masks and positions follow each microbatch's length. Linear products on a
parameter (``aten.linear``; ``aten.addmm`` as transformers' ``Conv1D``
issues it) become pipeweave's deferrable layers (``models.layers``), so
zero-bubble schedules defer their weight gradients to W (``nn.Linear`` s
that fx keeps whole are swapped when a layer is built: ``models.custom``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from pipeweave.errors import UserError
from pipeweave.models.layers import Linear, TransposedLinear

_ATEN = torch.ops.aten
_RANDOM = {
    _ATEN.dropout.default,
    _ATEN.native_dropout.default,
    _ATEN.bernoulli.default,
    _ATEN.rand.default,
    _ATEN.randn.default,
    _ATEN.randint.default,
    _ATEN.rand_like.default,
    _ATEN.randn_like.default,
    # the same as torch.fx records them (models.tracing's fallback)
    torch.rand,
    torch.randn,
    torch.randint,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.randperm,
    torch.bernoulli,
    torch.normal,
    torch.multinomial,
    torch.dropout,
    torch.nn.functional.dropout,
    "bernoulli_",
    "uniform_",
    "normal_",
    "random_",
    "exponential_",
}
_CALLS = ("call_function", "call_method", "call_module")
"""Nodes that compute (export's graphs have only ``call_function``; fx's have methods and leaf modules)."""


def check_split_points(module: nn.Module, split_points: Sequence[str]) -> None:
    """One line for a split point that names no submodule, or one named twice."""
    names = [n for n, _ in module.named_modules() if n]
    for point in split_points:
        if point not in names:
            parent = point.rsplit(".", 1)[0]
            near = [n for n in names if n.rsplit(".", 1)[0] == parent and n != parent][:6] or names[:6]
            raise UserError(
                f"split point {point!r} names no submodule of {type(module).__name__}; name one of its "
                f"modules, e.g. {', '.join(near)}"
            )
    if len(set(split_points)) != len(split_points):
        raise UserError(f"split points {list(split_points)} name a module twice; give each once")


def first_calls(graph: fx.Graph, split_points: Sequence[str]) -> dict[str, int]:
    """Per split point, the position among the compute nodes of the first one issued inside its module.

    Raises:
        UserError: a split point whose module the forward never calls.
    """
    first: dict[str, int] = {}
    nodes = [n for n in graph.nodes if n.op in _CALLS]
    for index, node in enumerate(nodes):
        for path, _ in node.meta.get("nn_module_stack", {}).values():
            for point in split_points:
                if point not in first and (path == point or path.startswith(point + ".")):
                    first[point] = index
    missing = [p for p in split_points if p not in first]
    if missing:
        raise UserError(f"split point {missing[0]!r} is a module the forward never calls; split at a module it runs")
    return first


def opening(graph: fx.Graph, module_names: set[str]) -> int:
    """The position among the compute nodes of the first one the module itself issues (``module_names``: its
    modules' names, the root's ``""`` included); export's guards and size reads before it are bookkeeping."""
    nodes = [n for n in graph.nodes if n.op in _CALLS]
    for index, node in enumerate(nodes):
        if any(path in module_names for path, _ in node.meta.get("nn_module_stack", {}).values()):
            return index
    return 0


def cuts(graph: fx.Graph, split_points: Sequence[str]) -> list[str]:
    """The split points that start a part, in execution order: one per place (a split before everything cuts
    nothing; of two starting at one node, the first named)."""
    starts: dict[int, str] = {}
    for point, index in sorted(first_calls(graph, split_points).items(), key=lambda item: item[1]):
        if index > 0:
            starts.setdefault(index, point)
    return list(starts.values())


def part_of_nodes(graph: fx.Graph, split_points: Sequence[str]) -> dict[fx.Node, int]:
    """Each compute node's part: how many cuts (``cuts``) have started at or before it, in execution order.

    Raises:
        UserError: a split point whose module the forward never calls.
    """
    first = first_calls(graph, split_points)
    starts = sorted({index for index in first.values() if index > 0})
    nodes = [n for n in graph.nodes if n.op in _CALLS]
    return {node: sum(1 for s in starts if s <= index) for index, node in enumerate(nodes)}


def _replicable(graph: fx.Graph, parameters: set[str]) -> set[fx.Node]:
    """Nodes computed from constants and buffers alone (no input, no parameter, nothing random)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if (
            node.op == "get_attr"
            and node.target not in parameters
            or isinstance(node.meta.get("val"), torch.SymInt)
            or node.op in _CALLS[:2]
            and node.target not in _RANDOM
            and all(a in out for a in node.all_input_nodes)
        ):
            out.add(node)
    return out


class _PartBuilder:
    """Copies one part's nodes into a graph of its own, recomputing replicable values it uses."""

    def __init__(self, live_in: list[fx.Node], replicable: set[fx.Node]) -> None:
        self.replicable = replicable
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.live_in = live_in
        for k, node in enumerate(live_in):
            self.env[node] = self.graph.placeholder(f"in_{k}_{node.name}")
            self.env[node].meta["val"] = node.meta.get("val")  # its shape: what a tensor-parallel split reads

    def value(self, node: fx.Node) -> Any:
        if node in self.env:
            return self.env[node]
        if node.op == "get_attr":
            self.env[node] = self.graph.get_attr(str(node.target))
        elif isinstance(node.meta.get("val"), torch.SymInt):
            self.env[node] = self._symbol(node)
        elif node in self.replicable:
            self.copy(node)
        else:
            self.env[node] = self._symbol(node)
        return self.env[node]

    def copy(self, node: fx.Node) -> None:
        self.env[node] = self.graph.node_copy(node, self.value)

    def _symbol(self, node: fx.Node) -> fx.Node:
        """A size (the dynamic batch) from the shape of a tensor that crossed into this part."""
        wanted = node.meta.get("val")
        if isinstance(wanted, torch.SymInt):
            for source in self.live_in:
                shape = getattr(source.meta.get("val"), "shape", ())
                for dim, size in enumerate(shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == wanted.node.expr:
                        return self.graph.call_function(_ATEN.sym_size.int, (self.env[source], dim))
            if node.op == "call_function":  # a size computed from sizes (heads x batch): from its own inputs
                return self.graph.node_copy(node, self.value)
        raise UserError(
            f"the split passes {node.name} ({type(wanted).__name__}) between parts, which is not a "
            "tensor; move the split point so that only tensors cross it"
        )


def split_graph(root: fx.GraphModule, split_points: Sequence[str]) -> list[fx.GraphModule]:
    """The parts of ``root``'s graph, cut at ``split_points`` (module names): one GraphModule each."""
    graph = root.graph
    part = part_of_nodes(graph, split_points)
    num_parts = max(part.values(), default=0) + 1
    parameters = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    replicable = _replicable(graph, parameters)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    for node in placeholders:
        part[node] = 0
    part[output] = num_parts - 1
    live = _live_values(graph, part, replicable, num_parts)
    live[0] = placeholders
    modules = []
    for k in range(num_parts):
        builder = _PartBuilder(live[k], replicable)
        for node in graph.nodes:
            if part.get(node) == k and node.op in _CALLS and node not in builder.env:
                builder.copy(node)
        if k + 1 < num_parts:
            outs = [builder.value(n) for n in live[k + 1]]
            _check_tensors(live[k + 1], k + 1)
            builder.graph.output(tuple(outs) if len(outs) != 1 else outs[0])
        else:
            outs = output.args[0]
            outs = outs[0] if isinstance(outs, (list, tuple)) and len(outs) == 1 else outs
            builder.graph.output(fx.node.map_arg(outs, builder.value))
        modules.append(_deferrable(fx.GraphModule(root, builder.graph)))
    return modules


def _live_values(
    graph: fx.Graph, part: dict[fx.Node, int], replicable: set[fx.Node], num_parts: int
) -> list[list[fx.Node]]:
    """Per part boundary k, the values made before part k and used from part k on (sent, not recomputed)."""
    live: list[list[fx.Node]] = [[] for _ in range(num_parts)]
    for node in graph.nodes:
        if node in replicable or node.op == "get_attr" or node not in part:
            continue
        last_use = max((part[u] for u in node.users if u in part), default=part[node])
        for k in range(part[node] + 1, last_use + 1):
            if node.meta.get("val") is not None and isinstance(node.meta["val"], torch.SymInt):
                continue  # read back from a crossing tensor's shape (_PartBuilder._symbol)
            live[k].append(node)
    return live


def _check_tensors(nodes: list[fx.Node], part: int) -> None:
    for node in nodes:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            raise UserError(
                f"at the start of part {part} the value {node.name} ({type(node.meta.get('val')).__name__}) "
                "would cross between parts, and only tensors can; move the split point"
            )


def _deferrable(module: fx.GraphModule) -> fx.GraphModule:
    """``aten.linear``/``aten.addmm`` on parameters swapped for pipeweave's deferrable layers (same Parameters)."""
    count = 0
    for node in list(module.graph.nodes):
        layer = _layer_for(module, node)
        if layer is None:
            continue
        name = f"pipeweave_linear_{count}"
        count += 1
        module.add_submodule(name, layer)
        with module.graph.inserting_before(node):
            x = node.args[0] if node.target == _ATEN.linear.default else node.args[1]
            call = module.graph.call_module(name, (x,))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        module.graph.erase_node(node)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


def _layer_for(module: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """A deferrable layer computing ``node`` from its parameters, or None if it is not such a product."""

    def parameter(arg: Any) -> nn.Parameter | None:
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and _is_parameter(module, str(arg.target)):
            return module.get_parameter(str(arg.target))
        return None

    if node.op != "call_function":
        return None
    if node.target == _ATEN.linear.default:
        weight = parameter(node.args[1])
        bias = parameter(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
        if weight is None or (len(node.args) > 2 and node.args[2] is not None and bias is None):
            return None
        return Linear.on(weight, bias)
    if node.target == _ATEN.addmm.default and len(node.args) == 3 and not node.kwargs:
        bias, weight = parameter(node.args[0]), parameter(node.args[2])
        if weight is None or bias is None or weight.dim() != 2 or bias.dim() != 1:
            return None
        return TransposedLinear.on(weight, bias)
    return None


def _is_parameter(module: nn.Module, target: str) -> bool:
    owner, _, name = target.rpartition(".")
    return name in module.get_submodule(owner)._parameters
