"""A traced part (``models.graph_split``) made to run on its tensor-parallel shard: the sizes written in its graph.

``torch.export`` records a module's Python with every size it computed
from its config as a literal: transformers' ``repeat_kv`` becomes
``expand(k, [b, 2, 2, s, 4])`` then ``reshape(.., [b, 4, s, 4])`` (key/value
heads, the group, the query heads), GPT-2's fused projection
``split(qkv, 16, 2)`` and ``view(x, [-1, 16])``. Once a column-parallel
layer keeps 1/N of the heads, those literals must be 1/N of what they were
(Megatron-LM's attention divides its head counts by the group's size in the
same way: ``num_attention_heads_per_partition``). ``local_sizes`` finds them
by running the graph twice on fake tensors (no memory) of concrete sizes:
whole, as traced, then on the shards, tracking which dimension of each value
a split left 1/N wide, and rewrites the size arguments of ``view``,
``reshape``, ``expand``, ``split`` and ``slice`` that act on such a
dimension. Any other value that comes out neither whole nor a clean 1/N of
the whole is one line naming where, and what leaves the part must be whole.

The shape rule of a view: a dimension ``i`` split N ways puts the factor N
outermost in it, ``prod(whole[:i])`` elements into the flat order; the output
dimension ``j`` holding that place (``prod(out[:j])`` divides it, and
``N x`` it divides ``prod(out[:j + 1])``) is the one that shrinks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from pipeweave.errors import UserError

_ATEN = torch.ops.aten
_SIZES = (101, 103, 107, 109)
"""Concrete values of a part's dynamic sizes (the batch, the sequence) for its fake run: primes, so that no model
width is mistaken for them."""
Shape = tuple[int, ...]


def whole_shapes(module: fx.GraphModule) -> dict[str, Any]:
    """Every node's output shape(s) in ``module`` (a tensor: its shape; a list of tensors: theirs), as traced."""
    return _FakeRun(module, None).shapes()


def local_sizes(module: fx.GraphModule, whole: Mapping[str, Any], where: str) -> None:
    """Rewrite the size arguments of ``module``'s graph for its split layers (``whole``: ``whole_shapes`` before).

    Raises:
        UserError: a value neither whole nor 1/N of the whole, or a part whose output would leave it split.
    """
    run = _FakeRun(module, whole, where)
    shapes = run.shapes()
    output = next(n for n in module.graph.nodes if n.op == "output")
    for node in output.all_input_nodes:
        if shapes[node.name] != whole[node.name]:
            raise UserError(
                f"{where}: its output {node.name} stays split over the tensor-parallel group "
                f"({list(shapes[node.name])} of {list(whole[node.name])}); give each colwise layer its rowwise "
                "partner in the tp_plan"
            )
    module.recompile()


class _FakeRun(fx.Interpreter):
    """The graph run on fake tensors; with ``whole`` given, its size arguments rewritten for split values."""

    def __init__(self, module: fx.GraphModule, whole: Mapping[str, Any] | None, where: str = "") -> None:
        super().__init__(module)
        self.whole, self.where = whole, where
        self.sizes: dict[str, int] = {}
        self.recorded: dict[str, Any] = {}

    def shapes(self) -> dict[str, Any]:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            inputs = [self._input(n) for n in self.graph.nodes if n.op == "placeholder"]
            self.run(*inputs)
        return self.recorded

    def _input(self, node: fx.Node) -> Any:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise UserError(f"{self.where}: input {node.name} of the part has no traced shape; trace it by export")
        shape = [self._concrete(size) for size in value.shape]
        return torch.empty(shape, dtype=value.dtype)

    def _concrete(self, size: Any) -> int:
        if isinstance(size, int):
            return size
        key = str(size.node.expr)
        if key not in self.sizes:
            self.sizes[key] = _SIZES[len(self.sizes) % len(_SIZES)] + 10 * (len(self.sizes) // len(_SIZES))
        return self.sizes[key]

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function" and n.target == _ATEN._assert_tensor_metadata.default:
            return None
        if n.op == "get_attr":  # shapes alone: a fake CPU tensor, wherever the part's tensors are (meta, a GPU)
            value = self.fetch_attr(str(n.target))
            if isinstance(value, torch.Tensor):
                return torch.empty(value.shape, dtype=value.dtype)
            return value
        if n.op == "call_module":
            result = self._module(n)
        else:
            if self.whole is not None and n.op == "call_function":
                self._rewrite(n)
            result = super().run_node(n)
        self.recorded[n.name] = _shape(result)
        if self.whole is not None and n.name in self.whole:
            _check_local(n, self.recorded[n.name], self.whole[n.name], self.where)
        return result

    def _module(self, n: fx.Node) -> Any:
        """A linear layer's output (split ones included: their collectives are not run here) or a leaf's run."""
        module = self.module.get_submodule(str(n.target))
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or len(n.args) != 1 or n.kwargs:
            return super().run_node(n)
        (x,) = self.map_nodes_to_values(n.args, n)
        transposed = getattr(module, "transposed", False)
        width = getattr(module, "output_width", weight.shape[1 if transposed else 0])
        features = weight.shape[0 if transposed else 1]
        if x.shape[-1] != features:
            raise UserError(
                f"{self.where}: {_place(n)} takes {features} features on a tensor-parallel shard and is given "
                f"{x.shape[-1]}; split layers come in pairs in the tp_plan: a colwise one, then its rowwise partner"
            )
        return x.new_empty((*x.shape[:-1], width))

    def _rewrite(self, n: fx.Node) -> None:
        rule = _RULES.get(n.target)  # type: ignore[arg-type]
        source = n.args[0] if n.args else None
        if rule is None or not isinstance(source, fx.Node) or not isinstance(self.whole, Mapping):
            return
        local, whole = self.recorded.get(source.name), self.whole.get(source.name)
        if not isinstance(local, tuple) or local == whole:
            return
        n.args = rule(n, local, whole, self.whole.get(n.name))


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    return None


def _check_local(n: fx.Node, local: Any, whole: Any, where: str) -> None:
    """A value whole, or its split dimensions each an even share of the whole."""
    if not isinstance(local, tuple) or local == whole:
        return
    if len(local) != len(whole) or any(w != v and (v == 0 or w % v) for v, w in zip(local, whole)):
        raise UserError(
            f"{where}: {n.name} (in {_place(n)}) has shape {list(local)} on a tensor-parallel shard where the whole has "
            f"{list(whole)}; its code cannot run on a share of the heads: leave it out of the tp_plan, or give a "
            "--tensor-parallel that divides its heads"
        )


def _place(n: fx.Node) -> str:
    """The module that issued ``n`` (its name in the traced module), or the node's name."""
    stack = list(n.meta.get("nn_module_stack", {}).values())
    return str(stack[-1][0]) if stack else n.name


def _split_dims(local: Shape, whole: Shape) -> list[tuple[int, int]]:
    """The dimensions a split made narrower, each with its ratio (whole / local)."""
    return [(i, w // v) for i, (v, w) in enumerate(zip(local, whole)) if v != w]


def _view(n: fx.Node, local: Shape, whole: Shape, out: Any) -> tuple[Any, ...]:
    """``view``/``reshape``: the output dimension holding each split's factor shrinks by it."""
    target = list(out)
    for i, ratio in _split_dims(local, whole):
        outer = math.prod(whole[:i])
        for j in range(len(out)):
            if outer % math.prod(out[:j]) == 0 and math.prod(out[: j + 1]) % (outer * ratio) == 0:
                target[j] = out[j] // ratio
                break
    return (n.args[0], _literals(n.args[1], target), *n.args[2:])


def _expand(n: fx.Node, local: Shape, whole: Shape, out: Any) -> tuple[Any, ...]:
    """``expand``: a dimension the source holds (not broadcast) keeps the source's local size."""
    target, lead = list(out), len(out) - len(whole)
    for i, ratio in _split_dims(local, whole):
        if whole[i] == out[lead + i]:
            target[lead + i] = out[lead + i] // ratio
    return (n.args[0], _literals(n.args[1], target), *n.args[2:])


def _split(n: fx.Node, local: Shape, whole: Shape, out: Any) -> tuple[Any, ...]:
    """``split``/``split_with_sizes`` along a split dimension: each piece 1/N as wide (heads of each of Q, K, V)."""
    dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % len(whole)
    ratio = dict(_split_dims(local, whole)).get(dim)
    if ratio is None:
        return tuple(n.args)
    sizes = n.args[1]
    shrunk = [s // ratio for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // ratio
    return (n.args[0], shrunk, *n.args[2:])


def _slice(n: fx.Node, local: Shape, whole: Shape, out: Any) -> tuple[Any, ...]:
    """``slice`` along a split dimension: its bounds 1/N (a fused projection's pieces, each split alike)."""
    args = list(n.args) + [0, None, None, 1][len(n.args) - 1 :]
    dim = args[1] % len(whole)
    ratio = dict(_split_dims(local, whole)).get(dim)
    if ratio is not None:
        for k in (2, 3):
            if isinstance(args[k], int) and 0 <= args[k] <= whole[dim]:
                args[k] //= ratio
    return tuple(args[: max(len(n.args), 4)])


def _literals(sizes: Sequence[Any], target: Sequence[int]) -> list[Any]:
    """``sizes`` with each literal (not -1, not a traced size) replaced by the target's."""
    return [t if isinstance(s, int) and s != -1 else s for s, t in zip(sizes, target)]


_RULES = {
    _ATEN.view.default: _view,
    _ATEN.reshape.default: _view,
    _ATEN._unsafe_view.default: _view,
    _ATEN.expand.default: _expand,
    _ATEN.split.Tensor: _split,
    _ATEN.split_with_sizes.default: _split,
    _ATEN.slice.Tensor: _slice,
}
