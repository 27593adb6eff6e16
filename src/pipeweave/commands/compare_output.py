"""``pipeweave compare``'s outputs: the rich table grouped sync/async, JSON, CSV, Markdown, the recommendation.

Literature beside ours in each column, the best value of each numeric column in
bold green (``compare_table.best``). The plot is ``commands.compare_plot``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeweave.commands.compare_table import best, recommend
from pipeweave.commands.outputs import output_file, picture_file, write_output

# (header, literature key or None, our key, format); shown when some row has our key.
COLUMNS: tuple[tuple[str, str | None, str, str], ...] = (
    ("bubble: survey | closed form | sim", "lit_bubble", "bubble_ratio", "ratio"),
    ("bubble sim +comm", None, "bubble_ratio_comm", "ratio"),
    ("activations / rank (M_a): survey | ours", "lit_activations", "peak_activations", "ranks"),
    ("weights / rank (M_theta): survey | ours", "lit_weights", "weight_versions", "ranks"),
    ("staleness | inconsistency", None, "staleness", "lag"),
    ("tied lag", None, "tied_lag", "most"),
    ("step sim (ms)", None, "step_time_s", "ms"),
    ("samples/s sim", None, "samples_per_s", "rate"),
    ("step measured (ms)", None, "measured_step_time_s", "ms"),
    ("samples/s measured", None, "measured_samples_per_s", "rate"),
    ("bubble measured | sim with run's costs", None, "measured_bubble_ratio", "measured"),
    ("activation | weight MiB measured (max rank)", None, "measured_peak_activation_bytes", "bytes"),
    ("convergence: survey | vs sync (mean, spread) | class", "lit_convergence", "convergence_mean", "loss"),
)


def output_paths(args: argparse.Namespace) -> dict[str, Path]:
    """The files ``--csv``, ``--markdown`` and ``--plot`` ask for, each checked writable (``commands.outputs``).

    Raises:
        UserError: one that cannot be written, in one line.
    """
    paths = {
        flag: output_file(f"--{flag}", value)
        for flag, value in (("csv", args.csv), ("markdown", args.markdown))
        if value
    }
    if args.plot:
        paths["plot"] = picture_file("--plot", args.plot)
    return paths


def emit(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    limit: tuple[float, str] | None,
    skipped: list[dict[str, str]] | None = None,
) -> None:
    """Print the table (or the JSON object) and write the asked files; paths are checked before writing.
    ``skipped``: the approaches that cannot serve the setting, with their reasons."""
    paths = output_paths(args)
    advice = recommend(rows, limit) if args.recommend or limit is not None else None
    setting = _setting(args)
    if "csv" in paths:
        write_output(paths["csv"], to_csv(rows))
    if "markdown" in paths:
        write_output(paths["markdown"], to_markdown(rows, setting, advice))
    if "plot" in paths:
        from pipeweave.commands.compare_plot import plot

        plot(rows, paths["plot"], convergence=args.convergence is not None)
    if args.json:
        out: dict[str, Any] = {"setting": setting, "approaches": rows, "skipped": skipped or []}
        if advice is not None:
            out["recommend"], out["excluded"] = advice
        print(json.dumps(out))
        return
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    console.print(rich_table(rows, setting))
    for line in _advice_lines(advice) + [f"skipped {e['name']}: {e['reason']}" for e in skipped or []]:
        console.print(line)
    for kind, path in paths.items():
        console.print(f"wrote {kind} to {path}")


def _setting(args: argparse.Namespace) -> dict[str, Any]:
    model = {k: getattr(args, k, None) for k in ("model", "layers", "hidden", "heads", "seq_len", "vocab")}
    return {
        "stages": args.stages,
        "microbatches": args.microbatches,
        "chunks": args.chunks,
        "batch": args.batch,
        "model": {k: v for k, v in model.items() if v is not None},
        "costs": args.costs or "profiled (cpu, 1 thread)",
        "measure_steps": args.measure,
        "rounds": args.rounds if args.measure else None,
        "convergence_steps": args.convergence,
        "seeds": args.seeds if args.convergence else None,
    }


def cell(row: dict[str, Any], key: str, kind: str) -> str:
    """Our value of column ``key`` in ``row`` as text ('' when the row has none)."""
    value = row.get(key)
    if value is None and kind not in ("lag", "measured"):
        return ""
    if kind == "ratio":
        return f"{value:.3f}"
    if kind == "ranks":
        return _ranks(value)
    if kind == "lag":
        return f"{max(row['staleness'], default=0)} | {max(row['inconsistency'], default=0)}"
    if kind == "most":
        return f"{max(value)}"
    if kind == "ms":
        return f"{value * 1e3:.2f}"
    if kind == "rate":
        return f"{value:.0f}"
    if kind == "measured":
        if row.get("measured_bubble_ratio") is None:
            return ""
        return f"{row['measured_bubble_ratio']:.3f} | {row['measured_bubble_ratio_simulated']:.3f}"
    if kind == "bytes":
        return f"{max(value) / 2**20:.2f} | {max(row['measured_weight_bytes']) / 2**20:.2f}"
    return f"{value:+.2%} ({row['convergence_spread']:.2%}) | {row['convergence_class']}"


def _ranks(values: list[float]) -> str:
    """``[4, 3, 2, 1]`` -> ``'4 3 2 1'``; long lists shortened to their range."""
    text = [f"{v:g}" for v in values]
    return " ".join(text) if len(text) <= 8 else f"{min(values):g}..{max(values):g}"


def _literature(row: dict[str, Any], key: str) -> str:
    if key == "lit_bubble":
        lit = row["lit_bubble"] + (f" = {row['lit_bubble_value']:.3f}" if row["lit_bubble_value"] is not None else "")
        closed = row["closed_bubble_value"]
        return f"{lit} | {f'{closed:.3f}' if closed is not None else row['closed_bubble']}"
    return str(row.get(key, "-"))


def _shown(rows: list[dict[str, Any]]) -> list[tuple[str, str | None, str, str]]:
    return [c for c in COLUMNS if any(r.get(c[2]) is not None for r in rows)]


def rich_table(rows: list[dict[str, Any]], setting: dict[str, Any]) -> Table:
    """The comparison as a rich table: synchronous rows, then asynchronous; best per column bold green."""
    columns = _shown(rows)
    title = (
        f"D = {setting['stages']}, T = {setting['microbatches']}, v = {setting['chunks']}, batch "
        f"{setting['batch']}, model {setting['model']}; costs {setting['costs']}"
    )
    table = Table(title=title, show_lines=False, header_style="bold")
    table.add_column("approach", no_wrap=True)
    for header, *_ in columns:
        table.add_column(header, overflow="fold")
    winners = {key: best(rows, key) for _, _, key, _ in columns}
    for group in (True, False):
        members = [r for r in rows if r["synchronous"] is group]
        if members:
            table.add_section()
            table.add_row(f"[italic]{'synchronous' if group else 'asynchronous'}[/italic]")
        for row in members:
            table.add_row(row["name"], *[_text(row, c, winners) for c in columns])
    return table


def _text(row: dict[str, Any], column: tuple[str, str | None, str, str], winners: dict[str, set[str]]) -> str:
    _, lit, key, kind = column
    ours = cell(row, key, kind)
    if ours and row["name"] in winners[key]:
        ours = f"[bold green]{ours}[/bold green]"
    return f"{_literature(row, lit)} | {ours}" if lit else ours


def to_csv(rows: list[dict[str, Any]]) -> str:
    """One row per approach, one column per field (lists as space-separated values)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(
            {
                k: " ".join(f"{x:g}" for x in v) if isinstance(v, list) and v and not isinstance(v[0], str) else v
                for k, v in row.items()
            }
        )
    return buffer.getvalue()


def to_markdown(
    rows: list[dict[str, Any]],
    setting: dict[str, Any],
    advice: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None,
) -> str:
    """The table as Markdown, best values in bold, under the run's hardware, date and commit."""
    columns = _shown(rows)
    winners = {key: best(rows, key) for _, _, key, _ in columns}
    lines = [
        "# pipeweave compare",
        "",
        f"{_provenance()}",
        "",
        f"Setting: `{json.dumps(setting)}`",
        "",
        "| approach | kind | " + " | ".join(_escaped(c[0]) for c in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for row in sorted(rows, key=lambda r: not r["synchronous"]):
        cells = []
        for _, lit, key, kind in columns:
            ours = _escaped(cell(row, key, kind))
            ours = f"**{ours}**" if ours and row["name"] in winners[key] else ours
            cells.append(f"{_escaped(_literature(row, lit))} \\| {ours}" if lit else ours)
        lines.append(f"| {row['name']} | {'sync' if row['synchronous'] else 'async'} | " + " | ".join(cells) + " |")
    lines += ["", *_advice_lines(advice)]
    return "\n".join(lines) + "\n"


def _escaped(text: str) -> str:
    """``text`` inside a Markdown table cell: its bars escaped."""
    return text.replace("|", "\\|")


def _advice_lines(advice: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None) -> list[str]:
    if advice is None:
        return []
    ranked, excluded = advice
    lines = [
        "Recommended (fits, fastest per sample first): "
        + ", ".join(f"{r['name']} ({r['time_per_sample_s'] * 1e3:.3f} ms/sample)" for r in ranked)
    ]
    lines += [f"  excluded {e['name']}: {e['reason']}" for e in excluded]
    return lines


def _cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _provenance() -> str:
    """Hardware, date and commit of this report."""
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    cores = os.cpu_count()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "absent"
    return (
        f"{now}, commit {commit}; {_cpu_name()} ({platform.machine()}, {cores} cores), "
        f"Python {platform.python_version()} on {platform.system()}, torch {torch}"
    )
