"""A griffe extension: this codebase's ``Example:`` sections read as Google-style ``Examples:``.

Google style names the section ``Examples:``; pipeweave's docstrings say ``Example:`` (torchgpipe's
habit). griffe would render such a section as a note whose doctest lines are Markdown, so the
extension renames the heading before griffe parses the docstring.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Renames every ``Example:`` section heading to ``Examples:``."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
