"""What ``pipeweave simulate`` prints: the metrics beside the registry's closed forms, as a table or as JSON."""

from __future__ import annotations

import ast
import operator
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeweave.schedule import Schedule
from pipeweave.schedule.registry import ScheduleInfo
from pipeweave.sim import CostModel, Metrics


def _cost_dict(cost: CostModel) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        return v if isinstance(v, (int, float)) else list(v)

    return {
        "f": plain(cost.f),
        "b": plain(cost.b),
        "w": plain(cost.w),
        "u": plain(cost.u),
        "comm": cost.comm,
        "dispatch": cost.dispatch,
        "mem_w": cost.mem_w,
        "recompute": cost.recompute,
    }


def as_json(
    schedule: Schedule, info: ScheduleInfo | None, cost: CostModel, metrics: Metrics, files: dict[str, str]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "schedule": schedule.name,
        "family": info.family if info else "csv",
        "synchronous": schedule.is_synchronous,
        "stages": schedule.num_ranks,
        "microbatches": schedule.num_microbatches,
        "chunks": schedule.num_chunks,
        "valid": True,
        "cost": _cost_dict(cost),
    }
    out.update(metrics.as_dict())
    out["closed_form"] = _closed_forms(schedule, info)
    out["files"] = files
    return out


_OPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate(formula: str, names: dict[str, float]) -> float | None:
    """The value of a plain arithmetic formula such as ``"(D-1)/(T+D-1)"``; None for prose.

    Example:
        >>> evaluate("(D-1)/(T+D-1)", {"D": 4, "T": 8})
        0.2727272727272727
        >>> evaluate("T M_a", {"T": 8}) is None
        True
    """

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id in names:
            return float(names[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(node)

    try:
        return walk(ast.parse(formula.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None


def _closed_forms(schedule: Schedule, info: ScheduleInfo | None) -> dict[str, Any]:
    if info is None:
        return {}
    names = {"D": float(schedule.num_ranks), "T": float(schedule.num_microbatches), "v": float(schedule.num_chunks)}
    value = evaluate(info.bubble, names)
    return {"bubble": info.bubble, "bubble_value": value, "activations": info.activations, "weights": info.weights}


def _short(values: tuple[float, ...] | tuple[int, ...], limit: int = 8) -> str:
    text = [f"{v:g}" for v in values]
    if len(text) <= limit:
        return ", ".join(text)
    return ", ".join(text[: limit // 2]) + ", ..., " + ", ".join(text[-limit // 2 :]) + f"  (max {max(values):g})"


def print_report(
    schedule: Schedule,
    info: ScheduleInfo | None,
    cost: CostModel,
    metrics: Metrics,
    timeline_text: str,
    files: dict[str, str],
) -> None:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    family = info.family if info else "CSV schedule"
    kind = "synchronous" if schedule.is_synchronous else "asynchronous"
    c = _cost_dict(cost)
    console.print(
        f"[bold]{schedule.name}[/bold] ({family}, {kind}): D={schedule.num_ranks} ranks, "
        f"T={schedule.num_microbatches} microbatches, v={schedule.num_chunks}; "
        f"f={c['f']} b={c['b']} w={c['w']} comm={c['comm']}"
        + "".join(f" {k}={c[k]}" for k in ("u", "dispatch") if c[k]),
        soft_wrap=True,
    )
    print(timeline_text)
    forms = _closed_forms(schedule, info)
    bubble_form = forms.get("bubble", "")
    if forms.get("bubble_value") is not None:
        bubble_form += f" = {forms['bubble_value']:.4f}"
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("simulated", overflow="fold")
    table.add_column("closed form", overflow="fold")
    table.add_row("makespan", f"{metrics.makespan:g}", "")
    table.add_row("bubble_ratio", f"{metrics.bubble_ratio:.4f}", bubble_form)
    table.add_row("bubble_ratio_flush", f"{metrics.bubble_ratio_flush:.4f}", "")
    table.add_row("bubble_overhead", f"{metrics.bubble_overhead:.4f}", "")
    widest = max(metrics.span, default=0.0)
    table.add_row("idle time / rank (max span - busy)", _short(tuple(round(widest - b, 9) for b in metrics.busy)), "")
    if not schedule.is_synchronous:
        table.add_row("steady_bubble_ratio", f"{metrics.steady_bubble_ratio:.4f}", "")
    table.add_row("peak activations / rank (M_a)", _short(metrics.peak_activations), forms.get("activations", ""))
    table.add_row("weight copies / rank (M_theta)", _short(metrics.weight_versions), forms.get("weights", ""))
    table.add_row("staleness / stage", _short(metrics.staleness), "0" if schedule.is_synchronous else "")
    console.print(table)
    for kind_, path in files.items():
        print(f"wrote {kind_} to {path}")
