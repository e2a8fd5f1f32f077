"""Operator JSON that a manifest may hold: bounded depth, finite numbers, integers Python can read.

``json.loads`` accepts ``NaN`` and ``Infinity`` (not JSON: the record export fails later, on every
attempt), a lone surrogate escape such as ``"\\ud800"`` (no UTF-8 form: the record, the guest and
``cleanroom inspect`` fail on it later), a key given twice (silently keeping the last value), raises
``RecursionError`` on a line nested some thousand levels deep and ``ValueError`` on an integer
over Python's digit limit. ``loads_line`` turns each into a ``JsonProblem`` naming the field;
``problem(value)`` checks an already parsed value (a dict from the Python API) without
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
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class JsonProblem(Exception):
    """A value a manifest must not hold, at ``path`` (dotted; empty for the whole line)."""

    path: str
    message: str

    def __str__(self) -> str:
        parts = self.path.split(".")
        path = ".".join(parts[:4]) + "..." if len(parts) > 5 else self.path
        return f"{path}: {self.message}" if path else self.message


class _Repeated(dict[str, Any]):
    """A JSON object that gave ``key`` more than once (only the check ever sees one)."""

    key: str = ""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: a dict, or a ``_Repeated`` naming a repeated key."""
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    seen: set[str] = set()
    repeated = _Repeated(out)
    for key, _ in pairs:
        if key in seen:
            repeated.key = key
            break
        seen.add(key)
    return repeated


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as an escape (safe to print or encode)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
        value = json.loads(line, parse_int=_int, object_pairs_hook=_pairs)
    except RecursionError:
        raise JsonProblem(_deep_key(line), f"nested deeper than {MAX_DEPTH} levels") from None
    found = problem(value)
    if found is not None:
        raise found
    return value


_NO_UTF8 = "a lone surrogate (such as \\ud800) has no UTF-8 form and is refused"


def problem(value: Any) -> JsonProblem | None:
    """The first thing in ``value`` a manifest must not hold, or None (iterative, no recursion)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                return JsonProblem(path, f"nested deeper than {MAX_DEPTH} levels")
            if isinstance(item, _Repeated):
                return JsonProblem(path, f"key {printable(item.key)!r} is given more than once")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in reversed(list(pairs)):
                name = printable(str(key))
                if isinstance(key, str) and _SURROGATE.search(key):
                    return JsonProblem(
                        f"{path}.{name}" if path else name, _NO_UTF8 + " (in its key)"
                    )
                stack.append((child, f"{path}.{name}" if path else name, depth + 1))
        elif isinstance(item, str) and _SURROGATE.search(item):
            return JsonProblem(path, _NO_UTF8)
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
