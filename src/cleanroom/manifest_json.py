"""Operator JSON that a manifest may hold: bounded depth, finite numbers, integers Python can read.

``json.loads`` accepts ``NaN`` and ``Infinity`` (not JSON: the record export fails later, on every
attempt), raises ``RecursionError`` on a line nested some thousand levels deep and ``ValueError``
on an integer over Python's digit limit. ``loads_line`` turns each into a ``JsonProblem`` naming
the field; ``problem(value)`` checks an already parsed value (a dict from the Python API) without
recursion, so a 100k-deep dict is refused as cleanly as a 100k-deep line.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 100
"""Containers nested deeper than this are refused (a task needs a handful of levels)."""
MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300
"""Python's own limit for reading an integer from text."""
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


@dataclass(frozen=True)
class JsonProblem(Exception):
    """A value a manifest must not hold, at ``path`` (dotted; empty for the whole line)."""

    path: str
    message: str

    def __str__(self) -> str:
        parts = self.path.split(".")
        path = ".".join(parts[:4]) + "..." if len(parts) > 5 else self.path
        return f"{path}: {self.message}" if path else self.message


@dataclass(frozen=True)
class _LongInt:
    """Stands in for an integer literal too long to read, so the check can name its field."""

    digits: int


def _int(text: str) -> int | _LongInt:
    digits = len(text.lstrip("-"))
    return _LongInt(digits) if digits > MAX_INT_DIGITS else int(text)


def loads_line(line: str) -> Any:
    """Parse one JSON line, refusing what ``problem`` refuses; ``json.JSONDecodeError`` for
    text that is not JSON at all."""
    try:
        value = json.loads(line, parse_int=_int)
    except RecursionError:
        raise JsonProblem(_deep_key(line), f"nested deeper than {MAX_DEPTH} levels") from None
    found = problem(value)
    if found is not None:
        raise found
    return value


def problem(value: Any) -> JsonProblem | None:
    """The first thing in ``value`` a manifest must not hold, or None (iterative, no recursion)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                return JsonProblem(path, f"nested deeper than {MAX_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in reversed(list(pairs)):
                stack.append((child, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(item, float) and not math.isfinite(item):
            return JsonProblem(path, f"{item} is not a JSON number (NaN and Infinity are refused)")
        elif isinstance(item, _LongInt):
            return JsonProblem(
                path, f"an integer of {item.digits} digits (at most {MAX_INT_DIGITS})"
            )
    return None


def _deep_key(line: str) -> str:
    """The top-level key whose value nests past ``MAX_DEPTH`` (empty if none is found)."""
    depth, key = 0, ""
    for match in _TOKENS.finditer(line):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return key
        elif token in "]}":
            depth -= 1
        elif depth == 1:
            key = json.loads(token)
    return ""
