"""The one check of a relative path chosen by someone else (standard library only, no ``re``).

The host checks the guest's artifact names with it (``wire.guest_name``), the guest checks the
members of a tar archive it unpacks (``native/tar.c`` restates it): valid text without control
characters, backslashes or lone surrogates, at most ``MAX_NAME`` bytes in at most ``MAX_NAME_PARTS``
components of at most ``MAX_NAME_PART`` bytes, relative, without empty, ``.`` or ``..`` parts.
"""

from __future__ import annotations

if __package__:
    from cleanroom.agent.protocol import MAX_NAME, MAX_NAME_PART, MAX_NAME_PARTS
else:  # in the guest, next to protocol.py
    from protocol import MAX_NAME, MAX_NAME_PART, MAX_NAME_PARTS  # type: ignore[no-redef,import-not-found]


def bad_char(c: str) -> bool:
    return c < " " or "\x7f" <= c <= "\x9f" or c == "\\" or "\ud800" <= c <= "\udfff"


def problem(name: object) -> str | None:
    """Why ``name`` is unsafe, as a template with ``{what}`` and ``{shown}``; None if safe."""
    if not isinstance(name, str) or not name:
        return "{what} is not a non-empty string"
    if any(bad_char(c) for c in name):
        return "{what} {shown} has a control character, backslash or lone surrogate"
    size = len(name.encode("utf-8"))
    if size > MAX_NAME:
        return "{what} {shown} is %d bytes (at most %d)" % (size, MAX_NAME)  # noqa: UP031
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return "{what} escapes its folder: {shown}"
    if len(parts) > MAX_NAME_PARTS:
        return "{what} {shown} has %d components" % len(parts)  # noqa: UP031
    if any(len(part.encode("utf-8")) > MAX_NAME_PART for part in parts):
        return "{what} {shown}: a component is longer than %d bytes" % MAX_NAME_PART  # noqa: UP031
    return None
