"""A module's forward as one graph: ``torch.export``, or ``torch.fx`` with its blocks kept whole where export fails.

``torch.export`` (non-strict: the module's Python runs as written) traces
every operation down to aten, and so refuses a forward that branches on a
tensor's values anywhere inside it -- a mixture of experts that skips an
expert no token was routed to, a block that returns early on padding. Where
it refuses, ``torch.fx``'s symbolic tracer is tried with the blocks (the
modules split points name, and every block of the module's ``nn.ModuleList``
s) kept whole as leaves: their forwards then run as written in each part,
and only the glue between them (an embedding, the loop, the head) must be
traceable. The values of that graph (``node.meta["val"]``, which the cut
needs: what crosses between parts must be a tensor) are recorded by running
it once on the example inputs, kept as shapes only (meta tensors); the
module's buffers and torch's random state are restored after.
A module neither can trace is one line: export's first error line and the way around.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import fx, nn

from pipeweave.errors import UserError


def trace(module: nn.Module, example_inputs: tuple[Any, ...], leaves: Collection[str] = ()) -> fx.GraphModule:
    """The module's forward as one graph holding its parameters (the same objects), by export or by fx.

    Args:
        module: the model as written.
        example_inputs: its forward's arguments, samples in dimension 0 (traced as dynamic).
        leaves: names of submodules fx keeps whole, should export fail.

    Raises:
        UserError: neither ``torch.export`` nor ``torch.fx`` can trace it (export's reason, and the way around).
    """
    try:
        with _quiet():  # export logs the graph it failed on; the reason is reported below, in one line
            return export(module, example_inputs)
    except Exception as e:
        refused = f"{type(e).__name__}: {_first_line(e)}"
    try:
        return fx_trace(module, example_inputs, leaves)
    except Exception as e:
        fx_refused = f"{type(e).__name__}: {_first_line(e)}"
    raise UserError(
        f"torch.export cannot trace {type(module).__name__}: {refused} (nor torch.fx: {fx_refused}); "
        "make its forward traceable (no Python branches on tensor values outside its blocks: torch.cond), "
        "or give an nn.Sequential or a pipeweave LayerModel, which need no tracing"
    ) from None


def export(module: nn.Module, example_inputs: tuple[Any, ...]) -> fx.GraphModule:
    """``torch.export``'s graph of the module (non-strict), dimensions 0 and 1 of every input dynamic where the
    module lets them be (``Dim.AUTO``): the batch, and a sequence's length (``--min-seq-len``).

    The examples are traced contiguous, as the ranks' batches come: with a dynamic length, the strides of an
    example cut from longer windows (``windows[:2, :-1]``) would become guards that every contiguous batch fails.
    """
    example_inputs = tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in example_inputs)
    dims = tuple(
        {d: torch.export.Dim.AUTO for d in range(min(x.dim(), 2))} if isinstance(x, torch.Tensor) else None
        for x in example_inputs
    )
    return torch.export.export(module, example_inputs, dynamic_shapes=dims, strict=False).module()


class _BlockTracer(fx.Tracer):
    """fx's tracer keeping the named submodules whole (``call_module``), besides torch's own leaf modules."""

    def __init__(self, leaves: Collection[str]) -> None:
        super().__init__()
        self.leaves = set(leaves)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


def fx_trace(module: nn.Module, example_inputs: tuple[Any, ...], leaves: Collection[str]) -> fx.GraphModule:
    """fx's graph of the module with ``leaves`` kept whole, each node's value recorded as a meta tensor."""
    root = fx.GraphModule(module, _BlockTracer(leaves).trace(module))
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    with torch.random.fork_rng(devices=[]):  # the run leaves no trace: random state, running statistics
        _Recorder(root).run(*example_inputs)
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    return root


class _Recorder(fx.Interpreter):
    """Runs a graph once and records each node's value in ``meta["val"]``: tensors as meta tensors (shapes)."""

    def run_node(self, n: fx.Node) -> Any:
        with torch.no_grad():
            result = super().run_node(n)
        n.meta["val"] = _shape_of(result)
        return result


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_shape_of(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_shape_of(v) for v in value)
    return value


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Inside, torch's log records up to ERROR are dropped and stderr is discarded (export prints the partial
    graph it failed on there); as before after."""
    before = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(before)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else "(no message)"
