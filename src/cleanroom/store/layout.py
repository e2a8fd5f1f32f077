"""Where an attempt's evidence lies in its episode folder, and how a reader finds the winner's.

Every attempt writes only under its own folder, ``attempts/<n>/`` (artifacts, logs, the
verifier's logs, the destroy proof), so two attempts of one episode (a retry on another node
while the first still finishes) never write the same name. The result record, first writer
wins, names the attempt that *is* the episode: ``evidence`` is its folder and every entry of
``artifacts`` and ``logs`` carries its ``path``. A record without them (record_version 1) is the
old layout: ``artifacts/<name>`` and ``logs/<name>`` beside ``result.json``.
"""

from __future__ import annotations

from typing import Any, Literal

Kind = Literal["artifacts", "logs"]


def attempt_dir(attempt: int) -> str:
    """The folder of one attempt's evidence, relative to the episode folder."""
    return f"attempts/{attempt}"


def listed(record: dict[str, Any], kind: Kind, name: str) -> str | None:
    """The stored path of the ``kind`` entry ``name`` the record lists (None if it lists none):
    its ``path``, or ``<kind>/<name>`` for a record of the old layout."""
    for entry in record.get(kind) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            path = entry.get("path")
            return path if isinstance(path, str) else f"{kind}/{name}"
    return None


def log_path(record: dict[str, Any] | None, attempt: int, name: str) -> str:
    """Where log ``name`` of ``attempt`` lies: the path the record lists when the record is that
    attempt's, else in the attempt's own folder (an attempt that did not reach a record)."""
    if record is not None and record.get("attempt") == attempt:
        found = listed(record, "logs", name)
        if found is not None:
            return found
        if "evidence" not in record:  # the old layout, a log the record does not list
            return f"logs/{name}"
    return f"{attempt_dir(attempt)}/logs/{name}"
