"""Why episodes failed, in one line each: the outcome, the error, the last line of stderr.

The stderr line comes from the stored (already redacted) log: for a final outcome the one the
durable record lists (the winning attempt's, whichever attempt the ledger row ends with), else
``attempts/<n>/logs/stderr.log`` of the attempt that did not reach one. Control
characters are dropped and the line is cut, so a guest cannot paint the operator's terminal.

The hint names only evidence the store holds: the stderr log, else (a guest that never got to
run anything: a failed boot) its console log, else the traceback of an unexpected error, else
the attempt's summary ``attempt.json``; none at all, and it names no file.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

from cleanroom.core.states import Outcome
from cleanroom.errors import CleanroomError, ConfigError
from cleanroom.ledger import EpisodeRow, Ledger
from cleanroom.store import Store, layout

LINE_WIDTH = 160
TAIL_BYTES = 64 * 1024  # the last line is looked for in this much of the log's end


@dataclass(frozen=True)
class Failure:
    episode_id: str
    attempt: int
    outcome: str
    error: str | None
    stderr: str | None  # its last non-empty line, cleaned; None if there is no stderr log
    log: str | None = "logs/stderr.log"  # its evidence in the episode's folder (None: none)


def last_line(data: bytes, width: int = LINE_WIDTH) -> str | None:
    """The last non-empty line of ``data``, printable characters only, at most ``width``."""
    for raw in reversed(data[-TAIL_BYTES:].decode("utf-8", "replace").splitlines()):
        line = "".join(c if c.isprintable() else " " for c in raw).strip()
        if line:
            return line if len(line) <= width else line[: width - 1] + "…"
    return None


def _failure(store: Store, run_id: str, row: EpisodeRow) -> Failure | None:
    """The row's failure with its attempt's stderr; when the episode has a durable record, the
    record's (the winning attempt's outcome and logs, whichever attempt the row is: a late
    attempt on a cluster ends ``superseded`` after the winner); None if that is ``completed``."""
    assert row.outcome is not None
    failure = Failure(row.episode_id, row.attempt, row.outcome, row.error, None)
    try:
        record = store.get_record(run_id, row.episode_id)
    except CleanroomError:
        record = None  # an unreadable record must not hide the summary
    if record is not None and isinstance(record.get("attempt"), int):
        if record.get("outcome") == Outcome.COMPLETED.value:
            return None
        error = (record.get("error") or {}).get("message")
        failure = Failure(
            row.episode_id, record["attempt"], str(record.get("outcome")), error, None
        )
    log = layout.log_path(record, failure.attempt, "stderr.log")
    data = _read(store, run_id, row.episode_id, log)
    if data is None:  # no stderr log (a launch that failed): the evidence there is instead
        return replace(failure, log=_other_evidence(store, run_id, row.episode_id, record, failure))
    return replace(failure, stderr=last_line(data) if data else None, log=log)


EVIDENCE = ("console.log", "traceback.txt")
"""What an attempt without a stderr log may keep instead, in the order a hint prefers."""


def _read(store: Store, run_id: str, episode_id: str, path: str) -> bytes | None:
    try:
        return store.get_bytes(run_id, episode_id, path)
    except CleanroomError:
        return None  # an unreadable log must not hide the summary


def _other_evidence(
    store: Store, run_id: str, episode_id: str, record: dict[str, Any] | None, failure: Failure
) -> str | None:
    """The first of ``EVIDENCE`` that the attempt kept, else its ``attempt.json``, else None."""
    paths = [layout.log_path(record, failure.attempt, name) for name in EVIDENCE]
    paths.append(f"{layout.attempt_dir(failure.attempt)}/attempt.json")
    return next((p for p in paths if _read(store, run_id, episode_id, p) is not None), None)


def failures(run_id: str, ledger: Ledger, store: Store) -> list[Failure]:
    """Every episode of the run whose latest attempt ended other than ``completed`` (and, if it
    has a durable record, whose record did)."""
    found = (
        _failure(store, run_id, row)
        for row in ledger.episodes(run_id)
        if row.outcome is not None and row.outcome != Outcome.COMPLETED.value
    )
    return [f for f in found if f is not None]


def attempts_kept(
    store: Store, ledger: Ledger, run_id: str, episode_id: str
) -> list[dict[str, Any]]:
    """What ``cleanroom inspect`` shows of an episode with no durable record: each attempt the
    ledger has of it in the run, oldest first, as its summary ``attempt.json`` (outcome, error,
    the logs it kept) or, if the store holds none, the ledger's row; each with ``evidence``,
    the folder of its files."""
    kept = []
    for row in ledger.episodes(run_id, all_attempts=True):
        if row.episode_id != episode_id:
            continue
        folder = layout.attempt_dir(row.attempt)
        data = _read(store, run_id, episode_id, f"{folder}/attempt.json")
        summary: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            loaded = json.loads(data) if data is not None else None
            summary = loaded if isinstance(loaded, dict) else {}
        if not summary:
            summary = {"attempt": row.attempt, "outcome": row.outcome, "error": row.error}
            summary["logs"] = []  # the store kept nothing of it (the ledger's word only)
        summary["evidence"] = f"{store.episode_uri(run_id, episode_id)}/{folder}"
        kept.append(summary)
    return kept


def parse_fail_on(text: str | None) -> frozenset[str]:
    """``--fail-on episode_error,timeout`` -> those outcome names; ConfigError for any other."""
    names = {part.strip() for part in (text or "").split(",") if part.strip()}
    known = {o.value for o in Outcome}
    unknown = sorted(names - known)
    if unknown:
        choices = ", ".join(sorted(known))
        raise ConfigError(f"--fail-on: unknown outcome(s) {', '.join(unknown)} (one of {choices})")
    return frozenset(names)


def report_lines(run_id: str, failed: list[Failure], total: int, where: str) -> list[str]:
    """What the summary prints about ``failed``: one line each (and its stderr), and a hint
    when every one of the run's ``total`` episodes failed (``where``: the run's store URI)."""
    lines = [f"failed episodes ({len(failed)} of {total}):"] if failed else []
    for f in failed:
        error = f.error.splitlines()[0][:LINE_WIDTH] if f.error else ""
        lines.append(f"  {f.episode_id}  {f.outcome}  {error}".rstrip())
        if f.stderr:
            lines.append(f"    stderr: {f.stderr}")
    if failed and len(failed) == total:
        first = failed[0]
        hint = (
            f"hint: every episode failed; look at one with `cleanroom inspect {first.episode_id}"
            f" --run-id {run_id}`"
        )
        if first.log is not None:
            name = PurePosixPath(first.log).name
            what = "stderr" if name == "stderr.log" else name
            hint += f" or its {what}: {where}/episodes/{first.episode_id}/{first.log}"
        lines.append(hint)
    return lines
