"""MkDocs hooks: the benchmarks' READMEs, kept beside their scripts, become pages of the site.

Measurements live in ``benchmarks/*/README.md`` (each with its date, commit and hardware), outside
``docs/``. The pages link to them as files of the repository (``../../benchmarks/x/README.md``
from ``docs/guide/``), which GitHub follows; here each such file is added to the site under
``benchmarks/`` and the links are rewritten to it, so ``mkdocs build --strict`` checks them too.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_SHOWN = {".md", ".png", ".svg"}
_LINK = re.compile(r"(\]\()([^)\s#]+)")


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Adds every README and picture under ``benchmarks/`` to the site, at ``benchmarks/...``."""
    root = Path(config.config_file_path).parent
    for path in sorted((root / "benchmarks").rglob("*")):
        if path.is_file() and path.suffix in _SHOWN:
            files.append(File(path.relative_to(root).as_posix(), str(root), config.site_dir,
                              config.use_directory_urls))
    return files


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Points a docs page's links into ``benchmarks/`` (one folder above ``docs/``) at the added pages."""
    if page.file.src_uri.startswith("benchmarks/"):
        return markdown
    folder = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        resolved = posixpath.normpath(posixpath.join(folder, target))
        if not resolved.startswith("../benchmarks/"):
            return match.group(0)
        return match.group(1) + posixpath.relpath(resolved[len("../"):], folder or ".")

    return _LINK.sub(rewrite, markdown)
