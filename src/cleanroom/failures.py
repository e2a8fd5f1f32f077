"""Why episodes failed, in one line each: the outcome, the error, the last line of stderr.

The stderr line comes from the stored (already redacted) log: ``logs/stderr.log`` for a final
outcome, ``attempts/<n>/logs/stderr.log`` for an attempt that did not reach one. Control
characters are dropped and the line is cut, so a guest cannot paint the operator's terminal.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleanroom.errors import CleanroomError, ConfigError
from cleanroom.ledger import EpisodeRow, Ledger
from cleanroom.record import Outcome
from cleanroom.store import Store

LINE_WIDTH = 160
TAIL_BYTES = 64 * 1024  # the last line is looked for in this much of the log's end
FINAL = {o.value for o in Outcome if o.final}


@dataclass(frozen=True)
class Failure:
    episode_id: str
    attempt: int
    outcome: str
    error: str | None
    stderr: str | None  # its last non-empty line, cleaned; None if there is no stderr log


def last_line(data: bytes, width: int = LINE_WIDTH) -> str | None:
    """The last non-empty line of ``data``, printable characters only, at most ``width``."""
    for raw in reversed(data[-TAIL_BYTES:].decode("utf-8", "replace").splitlines()):
        line = "".join(c if c.isprintable() else " " for c in raw).strip()
        if line:
            return line if len(line) <= width else line[: width - 1] + "…"
    return None


def _stderr(store: Store, run_id: str, row: EpisodeRow) -> str | None:
    prefix = "" if row.outcome in FINAL else f"attempts/{row.attempt}/"
    try:
        data = store.get_bytes(run_id, row.episode_id, f"{prefix}logs/stderr.log")
    except CleanroomError:
        return None  # an unreadable log must not hide the summary
    return last_line(data) if data else None


def failures(run_id: str, ledger: Ledger, store: Store) -> list[Failure]:
    """Every episode of the run whose latest attempt ended other than ``completed``."""
    return [
        Failure(row.episode_id, row.attempt, row.outcome, row.error, _stderr(store, run_id, row))
        for row in ledger.episodes(run_id)
        if row.outcome is not None and row.outcome != Outcome.COMPLETED.value
    ]


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
        log = "logs" if first.outcome in FINAL else f"attempts/{first.attempt}/logs"
        stderr = f"{where}/episodes/{first.episode_id}/{log}/stderr.log"
        lines.append(
            f"hint: every episode failed; look at one with `cleanroom inspect {first.episode_id}"
            f" --run-id {run_id}` or its stderr: {stderr}"
        )
    return lines
