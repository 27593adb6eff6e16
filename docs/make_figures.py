"""Regenerates the documentation's pictures and its table of closed forms, with pipeweave itself.

Run from the repository root after a schedule, its generator or the plot changes:

    python docs/make_figures.py

Every picture is ``pipeweave simulate -s NAME ... --plot docs/img/NAME.png`` at f = b = w = 1 and no
communication (the conditions of the closed forms), and the table of ``docs/guide/schedules.md``
between its two markers is ``pipeweave schedules --json``, the registry's own text.
``tests/test_docs.py`` checks that the table is current.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "img"
SCHEDULES_PAGE = ROOT / "docs" / "guide" / "schedules.md"
BEGIN, END = "<!-- closed forms: begin (docs/make_figures.py) -->", "<!-- closed forms: end -->"

# Sizes each picture is drawn at: D = 4 ranks, T = 8 microbatches unless the schedule needs others.
SIZES: dict[str, list[str]] = {
    "interleaved-1f1b": ["--chunks", "2"],
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


def with_table(page: str, table: str) -> str:
    """``page`` with the text between its markers replaced by ``table``."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main() -> None:
    entries = registry()
    IMAGES.mkdir(parents=True, exist_ok=True)
    for e in entries:
        name = str(e["name"])
        pipeweave("simulate", "-s", name, "--stages", "4", "--microbatches", "8", *SIZES.get(name, []),
                  "--plot", str(IMAGES / f"{name}.png"))
        print(f"docs/img/{name}.png")
    SCHEDULES_PAGE.write_text(with_table(SCHEDULES_PAGE.read_text(), closed_forms_table(entries)))
    print(f"{SCHEDULES_PAGE.relative_to(ROOT)}: table of {len(entries)} schedules")


if __name__ == "__main__":
    main()
