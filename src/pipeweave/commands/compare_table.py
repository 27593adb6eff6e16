"""What ``pipeweave compare`` shows, pure: the literature's claims, the class rule, Pareto fronts, recommendations.

The survey's Table 3 (Guan et al. 2024; ``REFERENCE.md``) and the zero-bubble
and DualPipe papers' claims, keyed by registry name; the convergence class of a
relative final loss (``benchmarks/convergence/README.md``'s rule); which rows are
best per column, on the Pareto front, or fit a memory limit. No torch, no numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pipeweave.errors import UserError
from pipeweave.schedule.registry import SCHEDULES

# name -> (bubble, convergence, weights, activations, extra mem / comp / comm), as the papers state them.
LITERATURE: dict[str, tuple[str, str, str, str, str]] = {
    "naive": ("(D-1)/D", "excellent", "M_theta", "M_a", "- / - / -"),
    "gpipe": ("(D-1)/(T+D-1)", "excellent", "M_theta", "T M_a", "- / - / -"),
    "1f1b": ("(D-1)/(D+T-1)", "excellent", "M_theta", "[M_a, D M_a]", "- / - / -"),
    "interleaved-1f1b": ("(D-1)/(v*T)", "excellent", "M_theta", "T M_a", "- / - / yes"),
    "chimera": ("(D-2)/(2*T+D-2)", "excellent", "2 M_theta", "[(D/2+1) M_a, D M_a]", "yes / - / yes"),
    "gems": ("~(D-1)/(D+1/2)", "excellent", "2 M_theta", "M_a", "yes / - / yes"),
    "zb-h1": ("(D-1)(F+B-W) time", "excellent", "M_theta", "D M_a", "- / yes / -"),
    "zb-h2": ("~0", "excellent", "M_theta", "(2D-1) M_a", "- / yes / -"),
    "zb-v": ("0 at F=B=W", "excellent", "M_theta", "D M_a", "- / yes / -"),
    "dualpipe": ("(D/2-1)(F&B+B-3W) time", "excellent", "2 M_theta", "(D+1) M_a", "yes / - / yes"),
    "ampnet": ("~0", "poor", "M_theta", "[M_a, D M_a]", "- / - / -"),
    "pipedream": ("~0", "good", "[M_theta, D M_theta]", "[M_a, D M_a]", "yes / - / -"),
    "xpipe": ("~0", "good (not all optimizers)", "M_theta", "[M_a, D M_a]", "yes / yes / -"),
    "spectrain": ("~0", "good (momentum SGD only)", "M_theta", "[M_a, D M_a]", "yes / yes / -"),
    "pipedream-2bw": ("~0", "good", "2 M_theta", "[M_a, D M_a]", "yes / - / -"),
    "pipemare": ("~0", "good", "M_theta", "[M_a, D M_a]", "yes / yes / -"),
    "avgpipe": ("~0", "good", "P M_theta", "[1, D T] P M_a", "yes / - / yes"),
    "wpipe": ("~0", "good", "2 M_theta", "T M_a", "yes / - / -"),
}

# The convergence class (benchmarks/convergence/README.md, set before its runs): r = final held-out loss /
# synchronous final held-out loss - 1; excellent r <= 1 %, good 1 % < r <= 5 %, poor r > 5 % or diverged.
EXCELLENT, GOOD = 0.01, 0.05

# Columns where more is better; every other numeric column: less is better.
HIGHER_IS_BETTER = ("samples_per_s", "measured_samples_per_s")


def choose(names: str | None, every: bool, registry: Sequence[str]) -> list[str]:
    """The approaches of ``-s a,b`` (in registry order), every one with ``--all``, or all but the searched ones
    (``ScheduleInfo.searched``: zb-auto, zb-v-auto, slower to build and the same step as zb-h1, zb-v here).

    Raises:
        UserError: a name the registry does not know.

    Example:
        >>> choose("gpipe,1f1b", False, ["naive", "gpipe", "1f1b"])
        ['gpipe', '1f1b']
    """
    if names is None:
        return [n for n in registry if every or not SCHEDULES[n].searched]
    given = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in given if n not in registry]
    if unknown or not given:
        raise UserError(
            f"-s {names!r}: unknown approach {unknown[0] if unknown else '(none)'!r}; choose from: "
            f"{', '.join(registry)}"
        )
    return [n for n in registry if n in given]


def classify(r: float) -> str:
    """The convergence class of a relative final loss ``r`` (nan or inf: diverged).

    Example:
        >>> classify(0.01), classify(0.0101), classify(0.05), classify(-0.2), classify(math.inf)
        ('excellent', 'good', 'good', 'excellent', 'poor')
    """
    if not math.isfinite(r) or r > GOOD:
        return "poor"
    return "excellent" if r <= EXCELLENT else "good"


def seed_summary(relative: Sequence[float]) -> dict[str, Any]:
    """Per approach over its seeds: mean and spread of ``relative``, class per seed and of the mean, and
    ``unstable`` where the seeds' classes disagree (the class of the mean then reads "good (unstable)").

    Example:
        >>> seed_summary([-0.0268, 0.088, -0.0235])["class"]
        'good (unstable)'
    """
    mean = sum(relative) / len(relative)
    classes = [classify(r) for r in relative]
    unstable = len(set(classes)) > 1
    return {
        "relative": list(relative),
        "mean": mean,
        "spread": max(relative) - min(relative),
        "classes": classes,
        "unstable": unstable,
        "class": classify(mean) + (" (unstable)" if unstable else ""),
    }


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (both lower is better).

    Example:
        >>> pareto([(1, 5), (2, 2), (3, 3), (5, 1)])
        [0, 1, 3]
    """

    def dominated(i: int) -> bool:
        x, y = points[i]
        return any(a <= x and b <= y and (a, b) != (x, y) for a, b in points)

    return [i for i in range(len(points)) if not dominated(i)]


def best(rows: Sequence[dict[str, Any]], key: str) -> set[str]:
    """Names of the rows best in column ``key`` (a number, or a list: its largest value), ties included."""
    values = {r["name"]: scalar(r.get(key)) for r in rows}
    values = {n: v for n, v in values.items() if v is not None and math.isfinite(v)}
    if not values:
        return set()
    pick: Callable[..., float] = max if key in HIGHER_IS_BETTER else min
    target = pick(values.values())
    return {n for n, v in values.items() if abs(v - target) <= 1e-9 * max(1.0, abs(target))}


def scalar(value: Any) -> float | None:
    """A column's comparable number: the value, a list's largest (the worst rank), None if absent."""
    if value is None or isinstance(value, (str, bool)):
        return None
    if isinstance(value, (list, tuple)):
        return max(value) if value else None
    return float(value)


def recommend(
    rows: Sequence[dict[str, Any]], limit: tuple[float, str] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows that fit ``limit`` ranked by time per sample (measured where there is one), and each other
    row with its reason.

    Raises:
        UserError: no approach fits the limit (the smallest need is named).
    """
    fits, excluded = [], []
    for row in rows:
        need = _activation_need(row, limit[1] if limit else "M_a")
        if limit is not None and need is not None and need > limit[0] * (1 + 1e-9):
            excluded.append(
                {
                    "name": row["name"],
                    "reason": f"needs {_need_text(need, limit[1])} of activations on its fullest rank, over the limit",
                }
            )
        elif time_per_sample(row) is None:
            excluded.append({"name": row["name"], "reason": "no time per sample"})
        else:
            fits.append(row)
    if not fits and rows:
        smallest = min(_activation_need(r, limit[1] if limit else "M_a") or math.inf for r in rows)
        flag = "--memory-limit" if limit and limit[1] == "bytes" else "--activation-limit"
        raise UserError(
            f"{flag} ({_need_text(limit[0], limit[1]) if limit else '-'} per rank) fits none of the "
            f"approaches; the least any needs is {_need_text(smallest, limit[1] if limit else 'M_a')}"
        )
    ranked = sorted(fits, key=lambda r: time_per_sample(r) or math.inf)
    return [{"name": r["name"], "time_per_sample_s": time_per_sample(r)} for r in ranked], excluded


def time_per_sample(row: dict[str, Any]) -> float | None:
    """Seconds per sample: measured where the row has it, else simulated."""
    rate = row.get("measured_samples_per_s") or row.get("samples_per_s")
    return 1.0 / rate if rate else None


def _activation_need(row: dict[str, Any], unit: str) -> float | None:
    if unit == "bytes":
        return scalar(row.get("measured_peak_activation_bytes")) or scalar(row.get("peak_activation_bytes"))
    return scalar(row.get("peak_activations"))


def _need_text(value: float, unit: str) -> str:
    return f"{value:g} M_a" if unit == "M_a" else f"{value / 2**20:.1f} MiB"
