"""The documentation builds: ``mkdocs build --strict`` (a broken link, anchor or API page fails), every name of
``pipeweave.__all__`` has its section in the API reference, its generated parts follow the registry, and the
README stays a front page."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeweave

ROOT = Path(__file__).resolve().parents[1]


def _documented_path(name: str) -> str:
    """Where docs/api.md documents public name ``name``: the module that defines it (``pipeweave._PUBLIC``)."""
    module, attribute = pipeweave._PUBLIC[name]
    return f"{module}.{attribute}"


def _make_figures():  # docs/make_figures.py is a script, not a module of the package
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "docs" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(180)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(ROOT / "mkdocs.yml"),
        "--site-dir",
        str(site),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    api = (site / "api" / "index.html").read_text()
    missing = [name for name in pipeweave.__all__ if f'id="{_documented_path(name)}"' not in api]
    assert not missing, f"{missing} of pipeweave.__all__ have no section in docs/api.md (::: MODULE.NAME)"
    assert (site / "benchmarks" / "runtime" / "index.html").exists()  # the benchmarks' READMEs are pages


def test_schedules_page_follows_the_registry() -> None:
    figures = _make_figures()
    page = figures.SCHEDULES_PAGE.read_text()
    entries = figures.registry()
    assert figures.schedules_page(page, entries) == page, "docs/guide/schedules.md is stale: run docs/make_figures.py"
    names = [str(e["name"]) for e in entries] + list(figures.FIGURES)
    missing = [name for name in names if not (figures.IMAGES / f"{name}.png").is_file()]
    assert not missing, f"no timeline for {missing}: run docs/make_figures.py"


def test_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = (
        "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e '.[test]'"
        " && python -m pytest"
    )
    assert test_command in ci and test_command in readme
    assert "pip install -c constraints.txt -e . && pipeweave train\n" in readme
    for link in (
        "docs/guide/train.md",
        "docs/guide/your-model.md",
        "docs/guide/compare.md",
        "docs/guide/plan.md",
        "docs/guide/torchrun.md",
    ):
        assert f"]({link})" in readme and (ROOT / link).is_file()
