"""The host's one boundary for what the guest sends: bounded JSON, validated names and text.

Every guest-facing parser on the host goes through here: frame headers (``decode_header``),
``result.json`` (``decode_json`` with ``RESULT``), artifact names (``guest_name``) and the
guest's own words in error messages (``guest_text``). Whatever the bytes are, the answer is a
value that is safe to use (finite numbers, valid UTF-8 strings, bounded depth and size) or a
``ProtocolError`` subclass; nothing else escapes (no ``RecursionError``, ``UnicodeError`` or
``OverflowError`` later, at ``os.open``, ``json.dumps`` or the store). The limits are the named
constants of ``protocol`` (shared with the guest agent).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from cleanroom.agent import names, protocol
from cleanroom.errors import FrameTooLarge, ProtocolError, UnsafePath

_SURROGATE = re.compile("[\ud800-\udfff]")
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


@dataclass(frozen=True)
class JsonLimits:
    """How much of a JSON document the host accepts from the guest."""

    max_bytes: int
    max_depth: int = protocol.MAX_JSON_DEPTH
    max_items: int = protocol.MAX_JSON_ITEMS
    max_int: int = protocol.MAX_JSON_INT


HEADER = JsonLimits(protocol.MAX_HEADER)
RESULT = JsonLimits(protocol.RESULT_MAX_BYTES)


def decode_json(raw: bytes, limits: JsonLimits, what: str) -> Any:
    """Decode strict, bounded JSON; raise ProtocolError (``what`` names it) for anything else.

    Refused: more than ``max_bytes``, invalid UTF-8, NaN/Infinity, a float that overflows
    (``1e999``), an integer beyond ``max_int``, nesting deeper than ``max_depth``, more than
    ``max_items`` values, a string or key with an unpaired surrogate (``"\\ud800"``).
    """
    if len(raw) > limits.max_bytes:
        raise FrameTooLarge(f"{what}: {len(raw)} bytes exceeds {limits.max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{what} is not valid JSON: not UTF-8 at byte {exc.start}") from None
    try:
        value = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            parse_int=lambda digits: _bounded_int(digits, limits.max_int),
        )
    except RecursionError:
        raise ProtocolError(f"{what} nests deeper than {limits.max_depth}") from None
    except ValueError as exc:  # JSONDecodeError, and the hooks' refusals
        raise ProtocolError(f"{what} is not valid JSON: {exc}") from None
    _check_tree(value, limits, what)
    return value


def decode_header(raw: bytes) -> dict[str, Any]:
    """A frame header: a bounded JSON object (an empty header is ``{}``)."""
    header = decode_json(raw, HEADER, "frame header") if raw else {}
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    return header


def guest_name(name: object, what: str = "artifact name") -> PurePosixPath:
    """Validate a guest-chosen relative path; raise UnsafePath unless it is safe to create.

    A name is valid UTF-8 text (no unpaired surrogate), without control characters or
    backslashes, at most ``MAX_NAME`` bytes in at most ``MAX_NAME_PARTS`` components of at
    most ``MAX_NAME_PART`` bytes each, relative, and without empty, ``.`` or ``..`` parts.
    """
    why = names.problem(name)
    if why is not None:
        shown = guest_text(name, protocol.MAX_NAME)  # whole (so redactable) unless oversized
        raise UnsafePath(why.format(what=what, shown=shown))
    assert isinstance(name, str)
    return PurePosixPath(name)


def guest_text(value: object, limit: int = protocol.MAX_MESSAGE) -> str:
    """The guest's words, safe to log: a string, unprintables as ``\\xNN``, at most ``limit``."""
    text = value if isinstance(value, str) else f"<{type(value).__name__}>"
    shown = _UNPRINTABLE.sub(_escape, text[:limit])
    return shown[:limit] + ("…" if len(shown) > limit or len(text) > limit else "")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed (strict JSON)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float (strict JSON)")
    return value


def _bounded_int(digits: str, max_int: int) -> int:
    if len(digits) > len(str(max_int)) + 1:
        raise ValueError(f"integer of {len(digits)} digits is out of range")
    value = int(digits)
    if abs(value) > max_int:
        raise ValueError(f"integer {digits} is out of range")
    return value


def _check_tree(value: Any, limits: JsonLimits, what: str) -> None:
    """Depth, item count and strings of a decoded document, without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    items = 0
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > limits.max_items:
            raise ProtocolError(f"{what} has more than {limits.max_items} values")
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise ProtocolError(f"{what} has a string with a lone surrogate")
        elif isinstance(node, dict | list):
            if depth > limits.max_depth:
                raise ProtocolError(f"{what} nests deeper than {limits.max_depth}")
            if isinstance(node, dict):
                stack.extend((key, depth) for key in node)
                stack.extend((child, depth + 1) for child in node.values())
            else:
                stack.extend((child, depth + 1) for child in node)
