"""Regenerates the documentation's pictures and its table of closed forms, with pipeweave itself.

Run from the repository root after a schedule, its generator or the plot changes:

    python docs/make_figures.py

Every picture is ``pipeweave simulate -s NAME ... --plot docs/img/NAME.png`` at f = b = w = 1 and no
communication (the conditions of the closed forms), and the table and the timelines of
``docs/guide/schedules.md`` (between their markers) come from ``pipeweave schedules --json``, the
registry's own text. ``tests/test_docs.py`` checks that both are current.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "img"
SCHEDULES_PAGE = ROOT / "docs" / "guide" / "schedules.md"
TABLE = ("<!-- closed forms: begin (docs/make_figures.py) -->", "<!-- closed forms: end -->")
GALLERY = ("<!-- timelines: begin (docs/make_figures.py) -->", "<!-- timelines: end -->")

# Sizes each picture is drawn at: D = 4 ranks, T = 8 microbatches unless the schedule needs others.
SIZES: dict[str, list[str]] = {
    "interleaved-1f1b": ["--chunks", "2"],
}

# Pictures of one guide each, beside the gallery: file name -> ``pipeweave simulate`` arguments.
# docs/guide/dualpipe.md: DeepSeek's own sizes (8 ranks and 20 microbatches; DualPipeV 4 ranks
# and 10) at f = 3, b = 2, w = 1, inside the region where its idle-time form holds exactly.
FIGURES: dict[str, list[str]] = {
    "dualpipe-d8-t20": ["-s", "dualpipe", "--stages", "8", "--microbatches", "20",
                        "--time-f", "3", "--time-b", "2", "--time-w", "1"],
    "dualpipe-v-d4-t10": ["-s", "dualpipe-v", "--stages", "4", "--microbatches", "10",
                          "--time-f", "3", "--time-b", "2", "--time-w", "1"],
}


def pipeweave(*args: str) -> str:
    """Runs ``pipeweave ARGS`` with this interpreter and returns what it printed."""
    run = subprocess.run([sys.executable, "-m", "pipeweave.cli", *args], capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"pipeweave {' '.join(args)} failed: {run.stderr.strip()}")
    return run.stdout


def registry() -> list[dict[str, object]]:
    """Every registered schedule as ``pipeweave schedules --json`` gives it."""
    return json.loads(pipeweave("schedules", "--json"))["schedules"]


def closed_forms_table(entries: list[dict[str, object]]) -> str:
    """The Markdown table of name, family, kind and closed forms, one row per schedule."""
    rows = ["| name | family | sync | bubble | activations | weights |", "|---|---|---|---|---|---|"]
    for e in entries:
        kind = "sync" if e["synchronous"] else "async"
        rows.append(f"| `{e['name']}` | {e['family']} | {kind} | {e['bubble']} "
                    f"| {e['activations']} | {e['weights']} |")
    return "\n".join(rows)


def gallery(entries: list[dict[str, object]]) -> str:
    """A heading and the timeline picture of every schedule, in the registry's order."""
    sections = []
    for e in entries:
        kind = "synchronous" if e["synchronous"] else "asynchronous"
        sections.append(f"### {e['name']}\n\n{e['family']}, {kind}. Bubble: {e['bubble']}; activations: "
                        f"{e['activations']}; weights: {e['weights']}.\n\n"
                        f"![{e['name']} timeline](../img/{e['name']}.png)")
    return "\n\n".join(sections)


def between(page: str, markers: tuple[str, str], text: str) -> str:
    """``page`` with what lies between ``markers`` replaced by ``text``."""
    begin, end = markers
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{text}\n{end}{tail}"


def schedules_page(page: str, entries: list[dict[str, object]]) -> str:
    """The schedules page with its generated table and timelines brought up to date."""
    return between(between(page, TABLE, closed_forms_table(entries)), GALLERY, gallery(entries))


def main() -> None:
    entries = registry()
    IMAGES.mkdir(parents=True, exist_ok=True)
    for e in entries:
        name = str(e["name"])
        pipeweave("simulate", "-s", name, "--stages", "4", "--microbatches", "8", *SIZES.get(name, []),
                  "--plot", str(IMAGES / f"{name}.png"))
        print(f"docs/img/{name}.png")
    for name, args in FIGURES.items():
        pipeweave("simulate", *args, "--plot", str(IMAGES / f"{name}.png"))
        print(f"docs/img/{name}.png")
    SCHEDULES_PAGE.write_text(schedules_page(SCHEDULES_PAGE.read_text(), entries))
    print(f"{SCHEDULES_PAGE.relative_to(ROOT)}: table of {len(entries)} schedules")


if __name__ == "__main__":
    main()
