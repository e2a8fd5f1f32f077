"""How much of one frame header an episode's RUN request may use, checked before anything runs.

The RUN request (``lifecycle.run.episode_request``) travels as one frame header, and the guest
agent refuses a header over ``protocol.MAX_HEADER`` (256 KiB: "header too large", the channel
closes, the attempt ends ``env_crashed``, and so does every retry and resume). Its parts come
from three owners, so each is held to a share, refused where its owner can fix it:

- the manifest's guest view (``task`` and the rest): at most ``MANIFEST_MAX``, a ``ManifestError``
  when the manifest is validated;
- the baseline's entry (its entrypoint or function, workdir and image ``Env``): at most
  ``ENTRY_MAX``, a ``BuildError`` (the builder calls ``check_entry``; a run checks it again);
- the whole request with the episode's secret values (sent twice: as environment and as files):
  at most ``MAX_HEADER``, checked for every manifest of a run before its first env
  (``request_problem``).

Sizes are of the JSON the wire carries (``protocol.dumps``: ASCII, so a non-ASCII character
counts 6 bytes as its ``\\uXXXX`` escape).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cleanroom.agent import protocol
from cleanroom.errors import BuildError

MAX_HEADER = protocol.MAX_HEADER
"""Bytes of one frame header, on both sides of the channel."""
MANIFEST_MAX = MAX_HEADER * 3 // 4
"""Bytes of a manifest's guest view (192 KiB)."""
ENTRY_MAX = MAX_HEADER // 4
"""Bytes of a baseline's entry: entrypoint or function, workdir, image ``Env`` (64 KiB)."""


def json_size(value: Any) -> int:
    """Bytes of ``value`` as the wire's JSON."""
    return len(protocol.dumps(value))


def manifest_problem(guest_view: Mapping[str, Any]) -> str | None:
    """Why a manifest's guest view cannot travel, naming its largest field; None if it can."""
    size = json_size(guest_view)
    if size <= MANIFEST_MAX:
        return None
    field = max(guest_view, key=lambda key: json_size(guest_view[key]))
    return (
        f"{field}: the manifest is {size} bytes as the guest gets it ({field}: "
        f"{json_size(guest_view[field])}); at most {MANIFEST_MAX} (one frame header of "
        f"{MAX_HEADER} bytes carries it with the baseline's entry and the secrets): "
        "pass large inputs as files (a session's put, or the baseline) instead"
    )


def entry_problem(
    entrypoint: Sequence[str] | Mapping[str, Any], env: Mapping[str, str], workdir: str | None
) -> str | None:
    """Why a baseline's entry is too large for the RUN request, or None."""
    parts = {"entrypoint": entrypoint, "env": env, "workdir": workdir}
    size = json_size(parts)
    if size <= ENTRY_MAX:
        return None
    sizes = ", ".join(f"{name} {json_size(value)}" for name, value in parts.items())
    return (
        f"the image's entrypoint, workdir and Env are {size} bytes as JSON ({sizes}); at most "
        f"{ENTRY_MAX}: the guest agent takes them in one frame header of {MAX_HEADER} bytes"
    )


def check_entry(
    where: str,
    entrypoint: Sequence[str] | Mapping[str, Any],
    env: Mapping[str, str],
    workdir: str | None = None,
) -> None:
    """Raise ``BuildError`` naming ``where`` (the image) if its entry is over ``ENTRY_MAX``."""
    problem = entry_problem(entrypoint, env, workdir)
    if problem is not None:
        raise BuildError(f"{where}: {problem}")


def request_problem(request: Mapping[str, Any]) -> str | None:
    """Why a whole RUN request is over ``MAX_HEADER``, naming its largest parts; or None."""
    size = json_size(request)
    if size <= MAX_HEADER:
        return None
    sizes = sorted(((json_size(v), k) for k, v in request.items()), reverse=True)
    largest = ", ".join(f"{key} {n}" for n, key in sizes[:3])
    return (
        f"the RUN request is {size} bytes as JSON ({largest}); the guest agent takes at most "
        f"{MAX_HEADER} in one frame header (secret values count twice: environment and files)"
    )
