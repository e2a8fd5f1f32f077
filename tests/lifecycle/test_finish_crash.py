"""An exception while an episode finishes (a bug in the export, say): ``Episode._keep_crash``.

The episode ends ``infra_error`` naming the exception, redacted; its attempt's evidence is
kept under ``attempts/<n>/`` (which env, which error, the whole traceback, redacted too, even
one holding text that is not valid UTF-8); and if keeping that evidence fails as well, the env
is still destroyed and confirmed absent. Fake driver, real store and ledger.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Owner
from cleanroom.errors import ExportError
from cleanroom.evidence.manifest import Manifest
from cleanroom.lifecycle.context import RunContext, RunOptions
from cleanroom.lifecycle.episode import Episode, EpisodeKey

from ..batch.test_controller import Harness

SECRET = "hf_CrashTimeSecretValue42"


@pytest.fixture
def h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    harness = Harness(tmp_path)
    yield harness
    harness.ledger.close()


def _manifest(eid: str) -> Manifest:
    return Manifest.model_validate(
        {"episode_id": eid, "seed": 1, "policy": {"id": "p"}, "secrets": ["HF_TOKEN"]}
    )


def _break_artifacts(h: Harness, *, attempts_too: bool = False) -> None:
    real_file, real_bytes = h.store.put_file, h.store.put_bytes

    def put_file(run_id: str, episode_id: str, rel: str, src: Path) -> Any:
        if episode_id == "x" and "/artifacts/" in rel:
            raise ValueError(f"bug near {SECRET} \ud800")  # a secret and a lone surrogate
        return real_file(run_id, episode_id, rel, src)

    def put_bytes(run_id: str, episode_id: str, rel: str, data: bytes) -> Any:
        if attempts_too and episode_id == "x" and rel.startswith("attempts/"):
            raise ExportError("ENOSPC: cannot write the attempt's evidence")  # as a store does
        return real_bytes(run_id, episode_id, rel, data)

    h.store.put_file = put_file  # type: ignore[method-assign]
    h.store.put_bytes = put_bytes  # type: ignore[method-assign]


def _stored_bytes(h: Harness) -> list[bytes]:
    files = [*(h.tmp / "store").rglob("*"), *h.tmp.glob("ledger.db*")]
    return [p.read_bytes() for p in files if p.is_file()]


async def test_a_crash_while_finishing_keeps_its_evidence_redacted(h: Harness) -> None:
    """Protects: the outcome is infra_error with the exception named and the secret redacted;
    attempts/1/attempt.json names the env and the error; traceback.txt holds the whole
    traceback (its lone surrogate escaped, not a second crash) without the secret; no stored
    byte holds the secret; the env is confirmed absent."""
    _break_artifacts(h)
    result = await h.ctl.run([_manifest("x")], h.baseline, run_id="rc")
    [ep] = result.episodes
    assert ep.outcome is Outcome.INFRA_ERROR
    assert ep.error is not None and "ValueError" in ep.error
    assert "[REDACTED:HF_TOKEN]" in ep.error and SECRET not in ep.error
    assert h.store.get_record("rc", "x") is None
    raw = h.store.get_bytes("rc", "x", "attempts/1/attempt.json")
    assert raw is not None
    summary = json.loads(raw)
    assert summary["outcome"] == "infra_error" and summary["error"] == ep.error
    assert summary["env_id"] == h.ledger.episodes("rc")[0].env_id and summary["env_id"]
    trace = h.store.get_bytes("rc", "x", "attempts/1/logs/traceback.txt")
    assert trace is not None
    assert trace.startswith(b"Traceback (most recent call last):\n  File ")
    assert b"ValueError" in trace and b"\\ud800" in trace and b"[REDACTED:HF_TOKEN]" in trace
    assert not [b for b in _stored_bytes(h) if SECRET.encode() in b]
    h.assert_all_destroyed("rc")


async def test_a_crash_whose_evidence_cannot_be_kept_still_destroys(h: Harness) -> None:
    """Protects: when keeping the attempt's evidence fails too, the episode still ends
    infra_error (the first exception, not the second) and its env is destroyed and confirmed
    absent; the rest of the batch completes."""
    _break_artifacts(h, attempts_too=True)
    both = [
        _manifest("x"),
        Manifest.model_validate({"episode_id": "y", "seed": 2, "policy": {"id": "p"}}),
    ]
    result = await h.ctl.run(both, h.baseline, run_id="rd")
    got = {e.episode_id: e for e in result.episodes}
    assert got["x"].outcome is Outcome.INFRA_ERROR and "ValueError" in (got["x"].error or "")
    assert got["y"].outcome is Outcome.COMPLETED, got["y"].error
    assert h.store.get_bytes("rd", "x", "attempts/1/attempt.json") is None
    h.assert_all_destroyed("rd")


async def test_a_full_disk_under_the_destroy_proof_loses_nothing_durable(h: Harness) -> None:
    """Protects: a store that raises ``OSError`` (ENOSPC) for ``destroy.json`` alone, after
    the record is durable: before, the OSError escaped the lease and the episode was reported
    ``infra_error`` although its durable record said ``completed``. Now it stays
    ``completed``, record and ledger agree, the env's absence is confirmed, and the failure
    is a ``destroy_proof_failed`` event naming the proof; the next episode runs as usual."""
    real_bytes = h.store.put_bytes

    def put_bytes(run_id: str, episode_id: str, rel: str, data: bytes) -> Any:
        if episode_id == "x" and rel.endswith("destroy.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_bytes(run_id, episode_id, rel, data)

    h.store.put_bytes = put_bytes  # type: ignore[method-assign]
    both = [_manifest("x"), _manifest("y")]
    result = await h.ctl.run(both, h.baseline, run_id="rp")
    assert [e.outcome for e in result.episodes] == [Outcome.COMPLETED] * 2
    record = h.store.get_record("rp", "x")
    assert record is not None and record["outcome"] == "completed"
    assert [r.outcome for r in h.ledger.episodes("rp")] == ["completed"] * 2
    h.assert_all_destroyed("rp")
    assert h.store.get_bytes("rp", "x", "attempts/1/destroy.json") is None
    assert h.store.get_bytes("rp", "y", "attempts/1/destroy.json") is not None
    [event] = h.ledger.events("rp", kind="destroy_proof_failed")
    assert event.episode_id == "x" and event.data["error"].startswith(
        "ENOSPC: cannot write the destroy proof attempts/1/destroy.json of episode x (run rp)"
    )


async def test_an_attempt_ended_after_its_run_keeps_the_runs_logs(h: Harness) -> None:
    """Protects: an attempt whose RUN finished but that ended non-final (here an exception in
    the episode's block after it) keeps what the run printed under attempts/<n>/logs/, beside
    attempt.json, not only the error; no durable record; the env is confirmed absent."""
    h.ledger.start_run(
        "ra", controller_id="c", baseline=h.baseline.digest, driver="fake", parallel=1, meta={}
    )
    h.ledger.episode_queued("ra", "x", 1)
    options = RunOptions(cleanup_window_s=5, staging_dir=h.tmp / "staging")
    ctx = RunContext(h.driver, h.ledger, h.store, Owner("c"), options=options)
    async with Episode(ctx, EpisodeKey("ra", "x", 1), _manifest("x"), h.baseline) as episode:
        await episode.provision()
        await episode.run()
        raise RuntimeError("after the run")
    assert episode.result.outcome is Outcome.INFRA_ERROR
    assert h.store.get_record("ra", "x") is None
    stdout = h.store.get_bytes("ra", "x", "attempts/1/logs/stdout.log")
    assert stdout is not None and b"stdout x seed=1" in stdout
    assert h.store.get_bytes("ra", "x", "attempts/1/attempt.json") is not None
    assert episode.result.destroy is not None and episode.result.destroy.confirmed_absent
    assert h.driver.list_owned() == []
