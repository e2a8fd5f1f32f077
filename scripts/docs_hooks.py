"""MkDocs hooks (mkdocs.yml ``hooks:``): the site shows the Markdown the suite runs.

A Python block that the suite runs is marked in its fence's info string, ```` ```python runnable
```` or ```` ```python runnable vm ```` (``tests/test_readme.py``). GitHub reads the first word as
the language; Python-Markdown's fences accept no such words and would show the block as text, so
the marker is dropped here, for the site only.
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^(\s*```python)[ \t]+runnable(?:[ \t]+vm)?[ \t]*$", re.MULTILINE)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """The page's Markdown with each runnable marker removed from its fence."""
    return MARKER.sub(r"\1", markdown)
