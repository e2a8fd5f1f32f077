"""Two attempts of one episode exporting at once (a retry on another node while the first
still finishes): each writes only under its own ``attempts/<n>/``, the first record decides
which attempt is the episode, and every reader (the run summary's failures, ``RunResult``'s
artifact paths) follows that record to the winner's files. Real ``LocalStore`` here; the same
race on a real S3-compatible server is in ``test_store_s3.py``. A record of the old layout
(no paths) stays readable. No VM.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from cleanroom.agent.connection import Artifact, EpisodeOutput, ExecResult
from cleanroom.batch.result import RunResult
from cleanroom.core.clock import EpisodeClock
from cleanroom.core.states import Outcome
from cleanroom.errors import RecordConflict
from cleanroom.evidence.export import export_episode
from cleanroom.evidence.manifest import Manifest
from cleanroom.ledger import Ledger
from cleanroom.observe.failures import failures
from cleanroom.store import LocalStore, Store
from cleanroom.store.layout import listed, log_path

from ..conftest import make_fake_baseline

RUN, EID = "race", "e"


class _Held(Exception):
    """The record write held back: the attempt has written its files, not yet its record."""


def _output(tmp: Path, attempt: int) -> EpisodeOutput:
    """Attempt ``attempt``'s evidence: the same names as every attempt, its own bytes."""
    root = tmp / f"staging-{attempt}"
    (root / "logs").mkdir(parents=True)
    (root / "logs" / "stdout.log").write_text(f"stdout of attempt {attempt}\n")
    (root / "logs" / "stderr.log").write_text(f"stderr of attempt {attempt}\n")
    art = root / "artifacts" / "out.txt"
    art.parent.mkdir()
    art.write_text(f"artifact of attempt {attempt}")
    data = art.read_bytes()
    return EpisodeOutput(
        exit=ExecResult(3, None, b"", b"", 0.5, False),
        artifacts=[Artifact("out.txt", len(data), hashlib.sha256(data).hexdigest(), art)],
        result_raw=json.dumps({"reward": float(attempt)}).encode(),
        stdout_path=root / "logs" / "stdout.log",
        stderr_path=root / "logs" / "stderr.log",
    )


def _files_then_hold(store: Store, tmp: Path, attempt: int) -> dict[str, Any]:
    """Export attempt ``attempt`` (an ``episode_error`` with output) up to its record; return
    the record it would write."""
    held: list[dict[str, Any]] = []
    real = store.put_record

    def hold(run_id: str, episode_id: str, record: dict[str, Any]) -> bool:
        held.append(record)
        raise _Held

    store.put_record = hold  # type: ignore[method-assign]
    manifest = Manifest.model_validate(
        {"episode_id": EID, "seed": attempt, "policy": {"id": "p", "version": "1"}}
    )
    try:
        with pytest.raises(_Held):
            export_episode(
                store,
                RUN,
                manifest,
                attempt,
                make_fake_baseline(tmp / f"baseline-{attempt}"),
                {"driver": "fake"},
                f"env-{attempt}",
                Outcome.EPISODE_ERROR,
                "entrypoint failed (exit code 3)",
                _output(tmp, attempt),
                {"console.log": f"console of attempt {attempt}".encode()},
                EpisodeClock(0.0),
            )
    finally:
        store.put_record = real  # type: ignore[method-assign]
    return held[0]


def race(store: Store, tmp: Path, winner: int) -> dict[str, Any]:
    """Both attempts write their files (the loser's after the winner's, the worst order for a
    shared path), then the winner's record goes first and the loser's is refused. Checks that
    every file the durable record lists holds the winner's bytes and lies in its folder, and
    that the loser's evidence is kept apart in its own; returns the record."""
    loser = 3 - winner
    records = {winner: _files_then_hold(store, tmp, winner)}
    records[loser] = _files_then_hold(store, tmp, loser)
    assert store.put_record(RUN, EID, records[winner]) is True
    with pytest.raises(RecordConflict):
        store.put_record(RUN, EID, records[loser])
    record = store.get_record(RUN, EID)
    assert record is not None and record["attempt"] == winner
    kinds = {"artifacts": ["out.txt"], "logs": ["stdout.log", "stderr.log", "console.log"]}
    for kind, names in kinds.items():
        assert [e["name"] for e in record[kind]] == names
        for entry in record[kind]:
            rel = listed(record, kind, entry["name"])  # as every reader finds it
            data = store.get_bytes(RUN, EID, rel) if rel else None
            assert data is not None and hashlib.sha256(data).hexdigest() == entry["sha256"], rel
            assert f"of attempt {winner}".encode() in data, rel
            assert rel == entry["path"] and rel.startswith(f"attempts/{winner}/{kind}/"), rel
    assert record["evidence"] == f"attempts/{winner}"
    kept = store.get_bytes(RUN, EID, f"attempts/{loser}/artifacts/out.txt")
    assert kept == f"artifact of attempt {loser}".encode()  # the loser's, apart
    return record


@pytest.mark.parametrize("winner", [1, 2])
def test_a_losing_attempt_never_replaces_the_winners_files(tmp_path: Path, winner: int) -> None:
    """Protects: with every attempt writing the same names beside ``result.json`` (the old
    layout), the loser's late files replaced the winner's and the record's hashes no longer
    matched its files; per-attempt folders keep both, and the record names the winner's."""
    race(LocalStore(tmp_path / "store"), tmp_path, winner)


def _ledger(tmp: Path, rows: list[tuple[int, Outcome]]) -> Ledger:
    ledger = Ledger(tmp / "ledger.db")
    ledger.start_run(
        RUN, controller_id="c", baseline="sha256:x", driver="fake", parallel=1, meta={}
    )
    for attempt, outcome in rows:
        ledger.episode_queued(RUN, EID, attempt)
        ledger.episode_finished(RUN, EID, attempt, outcome=outcome.value, error=outcome.value)
    return ledger


@pytest.mark.parametrize("winner", [1, 2])
def test_the_run_summary_shows_the_winners_stderr(tmp_path: Path, winner: int) -> None:
    """Protects: the summary of a retried episode names the outcome and stderr of the attempt
    whose record is durable, even when the ledger's latest row is the late loser's
    (``superseded``), never the loser's log (the old reader took a fixed ``logs/`` path, or the
    superseded attempt's own)."""
    store = LocalStore(tmp_path / "store")
    race(store, tmp_path, winner)
    loser = 3 - winner
    rows = sorted([(winner, Outcome.EPISODE_ERROR), (loser, Outcome.SUPERSEDED)])
    with _ledger(tmp_path, rows) as ledger:
        [failure] = failures(RUN, ledger, store)
    assert (failure.attempt, failure.outcome) == (winner, "episode_error")
    assert failure.stderr == f"stderr of attempt {winner}"
    assert failure.log == f"attempts/{winner}/logs/stderr.log"


def test_the_api_artifact_path_is_the_winners(tmp_path: Path) -> None:
    """Protects: ``RunResult.artifact_path`` (the Python API) follows the record to the
    winning attempt's file, not a fixed ``artifacts/`` path beside the record."""
    store = LocalStore(tmp_path / "store")
    race(store, tmp_path, 2)
    path = RunResult(RUN, store=store).artifact_path(EID, "out.txt")
    assert path.read_text() == "artifact of attempt 2"


def test_a_record_of_the_old_layout_is_still_read(tmp_path: Path) -> None:
    """Protects: a run folder written before per-attempt paths (record_version 1: no
    ``evidence``, no ``path``; files beside ``result.json``) reads as before: the summary's
    stderr and the API's artifact path come from ``logs/`` and ``artifacts/``."""
    store = LocalStore(tmp_path / "store")
    store.put_bytes(RUN, EID, "logs/stderr.log", b"old stderr\n")
    store.put_bytes(RUN, EID, "artifacts/out.txt", b"old artifact")
    entry = {"name": "stderr.log", "size": 11, "sha256": "0" * 64}
    record = {"record_version": 1, "episode_id": EID, "run_id": RUN, "attempt": 1}
    record |= {"outcome": "episode_error", "error": {"message": "failed"}, "logs": [entry]}
    record["artifacts"] = [{"name": "out.txt", "size": 12, "sha256": "0" * 64}]
    store.put_record(RUN, EID, record)
    assert listed(record, "logs", "stderr.log") == "logs/stderr.log"
    with _ledger(tmp_path, [(1, Outcome.EPISODE_ERROR)]) as ledger:
        [failure] = failures(RUN, ledger, store)
    assert (failure.stderr, failure.log) == ("old stderr", "logs/stderr.log")
    path = RunResult(RUN, store=store).artifact_path(EID, "out.txt")
    assert path.read_bytes() == b"old artifact"


def test_each_attempts_log_is_looked_for_where_its_layout_puts_it() -> None:
    """Protects where every reader looks for an attempt's log (``layout.log_path``): the path
    the record lists when the record is that attempt's (wherever it lies); the attempt's own
    folder when there is no record, the record is another attempt's, or a record of this
    layout does not list the log; beside the record only for the old layout."""
    verify = {"name": "verify.log", "path": "attempts/2/verify/verify.log"}
    new = {"attempt": 2, "evidence": "attempts/2", "logs": [verify]}
    old = {"record_version": 1, "attempt": 1, "logs": [{"name": "stderr.log"}]}
    assert log_path(new, 2, "verify.log") == "attempts/2/verify/verify.log"
    assert log_path(new, 1, "verify.log") == "attempts/1/logs/verify.log"
    assert log_path(new, 2, "stdout.log") == "attempts/2/logs/stdout.log"
    assert log_path(None, 3, "stdout.log") == "attempts/3/logs/stdout.log"
    assert log_path(old, 1, "stderr.log") == "logs/stderr.log"
    assert log_path(old, 1, "stdout.log") == "logs/stdout.log"
