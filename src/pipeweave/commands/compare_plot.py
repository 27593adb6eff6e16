"""``pipeweave compare --plot``: the trade-off, each approach a labelled point, the Pareto front marked.

Left: bubble ratio against peak activations per rank (fewer of both is
better); right: time per sample against peak activations (measured where
measured). With ``--convergence``, a third panel: time per sample against the
final held-out loss relative to synchronous training.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pipeweave.commands.compare_table import pareto, scalar, time_per_sample
from pipeweave.commands.outputs import replaced_output

PANELS: tuple[tuple[str, str, str], ...] = (
    ("peak_activations", "bubble_ratio", "bubble ratio (simulated)"),
    ("peak_activations", "time_per_sample", "time per sample (s; measured where measured)"),
)


def _value(row: dict[str, Any], key: str) -> float | None:
    if key == "time_per_sample":
        return time_per_sample(row)
    return scalar(row.get(key))


def plot(rows: list[dict[str, Any]], path: Path, convergence: bool = False) -> None:
    """Write the picture to ``path`` (whole or not at all)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(PANELS) + ([("convergence_mean", "time_per_sample", "time per sample (s)")] if convergence else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.2), squeeze=False)
    for ax, (x_key, y_key, y_label) in zip(axes[0], panels):
        _panel(ax, rows, x_key, y_key)
        ax.set_xlabel(
            "final held-out loss vs synchronous (mean over seeds)"
            if x_key == "convergence_mean"
            else "peak activations on the fullest rank (M_a)"
        )
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("pipeweave compare: synchronous (o), asynchronous (^); Pareto front ringed")
    fig.tight_layout()
    with replaced_output(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix[1:])
    plt.close(fig)


def _panel(ax: Any, rows: list[dict[str, Any]], x_key: str, y_key: str) -> None:
    points = [(r, _value(r, x_key), _value(r, y_key)) for r in rows]
    points = [(r, x, y) for r, x, y in points if x is not None and y is not None and math.isfinite(x + y)]
    for group, marker in ((True, "o"), (False, "^")):
        xs = [x for r, x, _ in points if r["synchronous"] is group]
        ys = [y for r, _, y in points if r["synchronous"] is group]
        ax.scatter(xs, ys, marker=marker, label="synchronous" if group else "asynchronous")
    labels: dict[tuple[float, float], tuple[float, float, list[str]]] = {}  # approaches at one point share a label
    for r, x, y in points:  # x: M_a or a relative loss (4 decimals); y: 4 significant digits
        labels.setdefault((round(x, 4) + 0.0, float(f"{y:.4g}")), (x, y, []))[2].append(r["name"])
    for x, y, names in labels.values():
        ax.annotate(", ".join(names), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = sorted((points[i][1], points[i][2]) for i in pareto([(x, y) for _, x, y in points]))
    if front:  # the front as a staircase through its points, each ringed
        ax.plot([p[0] for p in front], [p[1] for p in front], "k--", linewidth=1, drawstyle="steps-post")
        ax.scatter(
            [p[0] for p in front], [p[1] for p in front], s=170, facecolors="none", edgecolors="k", label="Pareto front"
        )
