"""Move an episode's staged evidence into the durable store, the result record last.

Every attempt writes under its own folder, ``attempts/<n>/`` (``store.layout``), so a late
attempt never replaces the winner's files. ``export_episode`` is for final outcomes: artifacts
and logs first (each confirmed by the store), then the signed attestation over them and the
record (``evidence.attest``), then ``result.json``, which names the attempt's
folder (``evidence``) and each file's ``path``; only after that is the episode durable, and
the first record written decides which attempt *is* the episode. ``export_attempt`` keeps what
can be had of a non-final attempt (logs, console tail, the error) in the same folder.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from cleanroom.agent import wire
from cleanroom.agent.connection import Artifact, EpisodeOutput
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.core.version import __version__
from cleanroom.errors import EvidenceError, ExportError, ProtocolError, UnsafePath
from cleanroom.evidence import attest, keys
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.record import cleanroom_revision, host_facts, parse_guest_result
from cleanroom.evidence.secrets import Redactor
from cleanroom.evidence.statements import episode_statement
from cleanroom.host.digests import digest_of, sha256_file
from cleanroom.store import Store, StoredFile
from cleanroom.store.base import record_bytes
from cleanroom.store.layout import attempt_dir

if TYPE_CHECKING:
    from cleanroom.core.clock import EpisodeClock

RECORD_VERSION = 2  # 2: evidence under attempts/<n>/, each file's path in the record


def redact_output(
    output: EpisodeOutput | None, diagnostics: dict[str, bytes], redactor: Redactor | None
) -> dict[str, bytes]:
    """Replace secret values in everything staged (files in place, artifact names, the result
    record as parsed JSON); return clean diagnostics."""
    if not redactor:
        return diagnostics
    if output is not None:
        for path in (output.stdout_path, output.stderr_path):
            if path is not None and path.exists():
                redactor.file(path)
        taken: set[str] = set()
        output.artifacts = [_redact_artifact(a, redactor, taken) for a in output.artifacts]
        if output.result_raw is not None:
            output.result_raw = _redact_result(output.result_raw, redactor)
    return {name: redactor.redact(data) for name, data in diagnostics.items()}


def _redact_artifact(artifact: Artifact, redactor: Redactor, taken: set[str]) -> Artifact:
    """The artifact with its content redacted and, if its name held a secret, moved to the
    redacted name (made unique among ``taken``) inside the same staging folder."""
    redactor.file(artifact.path)
    name = redactor.redact_text(artifact.name)
    path = artifact.path
    if name != artifact.name:
        root = artifact.path.parents[len(PurePosixPath(artifact.name).parts) - 1]
        name = _unique(name, taken)
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(artifact.path, path)
        for folder in artifact.path.parents:  # the old name's folders may spell it too
            if folder == root or any(folder.iterdir()):
                break
            folder.rmdir()
    taken.add(name)
    return Artifact(name, path.stat().st_size, sha256_file(path), path)


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken or not _valid_name(candidate):
        n += 1
        candidate = f"redacted-{n}" if n > 99 else f"{name[:200]}~{n}"
    return candidate


def _valid_name(name: str) -> bool:
    try:
        wire.guest_name(name)
    except UnsafePath:
        return False
    return True


def _redact_result(raw: bytes, redactor: Redactor) -> bytes:
    """result.json redacted as the JSON it means (keys, strings, escapes); bytes that are not
    valid JSON (the episode fails on them anyway) are redacted as bytes."""
    try:
        value = wire.decode_json(raw, wire.RESULT, "result.json")
    except ProtocolError:
        return redactor.redact(raw)
    return json.dumps(
        redactor.redact_json(value), ensure_ascii=False, separators=(",", ":")
    ).encode()


def secrets_summary(manifest: Manifest, redactor: Redactor | None) -> dict[str, Any]:
    """Names and redaction counts only: a value never enters a record."""
    return {
        "names": [s.name for s in manifest.secrets],
        "redactions": dict(redactor.counts) if redactor else {},
    }


def _put_logs(
    store: Store,
    run_id: str,
    eid: str,
    folder: str,
    output: EpisodeOutput | None,
    diagnostics: dict[str, bytes],
) -> list[dict[str, Any]]:
    logs = []
    if output is not None:
        for path in (output.stdout_path, output.stderr_path):
            if path is not None and path.exists():
                stored = store.put_file(run_id, eid, f"{folder}/logs/{path.name}", path)
                logs.append(_entry(path.name, stored))
    for name, data in sorted(diagnostics.items()):
        stored = store.put_bytes(run_id, eid, f"{folder}/logs/{name}", data)
        logs.append(_entry(name, stored))
    return logs


def _entry(name: str, stored: StoredFile) -> dict[str, Any]:
    """A file as the record lists it: its name, address and where it lies in the store."""
    return {"name": name, "size": stored.size, "sha256": stored.sha256, "path": stored.name}


def export_episode(
    store: Store,
    run_id: str,
    manifest: Manifest,
    attempt: int,
    baseline: Baseline,
    facts: dict[str, Any],
    env_id: str,
    outcome: Outcome,
    error: str | None,
    output: EpisodeOutput,
    diagnostics: dict[str, bytes],
    clock: EpisodeClock,
    redactor: Redactor | None = None,
    *,
    verdict: dict[str, Any] | None = None,
    signing_key: Path | None = None,
) -> dict[str, Any]:
    """Write artifacts, logs, the signed attestation, then the record (with the verifier's
    ``verdict``, if any). Raises StoreError; returns the record.

    The attestation (``evidence.attest``) is signed with ``signing_key`` (default: the home's
    key, ``evidence.keys``) over the record's exact stored bytes, and written just before the
    record, so a durable record always has its statement beside it."""
    eid = manifest.episode_id
    diagnostics = redact_output(output, diagnostics, redactor)
    error = redactor.redact_text(error) if redactor and error else error
    folder = attempt_dir(attempt)
    artifacts = []
    for artifact in output.artifacts:
        stored = store.put_file(run_id, eid, f"{folder}/artifacts/{artifact.name}", artifact.path)
        if stored.sha256 != artifact.sha256:
            raise ExportError(f"artifact {artifact.name}: stored bytes differ from what arrived")
        artifacts.append(_entry(artifact.name, stored))
    logs = _put_logs(store, run_id, eid, folder, output, diagnostics)
    clock.lap("export_s")
    guest = parse_guest_result(output.result_raw)
    record: dict[str, Any] = {
        "record_version": RECORD_VERSION,
        "episode_id": eid,
        "run_id": run_id,
        "attempt": attempt,
        "outcome": outcome.value,
        "verdict": verdict,
        "reward": guest.reward,
        "terminated": guest.terminated,
        "truncated": guest.truncated,
        "info": guest.info,
        "metrics": guest.metrics,
        "seed": manifest.seed,
        "policy": manifest.policy.model_dump(mode="json"),
        "task": manifest.task,
        "exit": {
            "code": output.exit.exit_code,
            "signal": output.exit.signal,
            "timed_out": output.exit.timed_out,
            "duration_s": output.exit.duration_s,
        },
        "error": {"message": error} if error else None,
        "evidence": folder,
        "artifacts": artifacts,
        "logs": logs,
        "secrets": secrets_summary(manifest, redactor),
        "provenance": {
            "baseline": baseline.digest,
            "baseline_name": baseline.name,
            "spec_digest": baseline.spec_digest,
            "kernel": baseline.kernel_version,
            "agent_version": baseline.agent_version,
            **({"agent_sha256": baseline.agent_sha256} if baseline.agent_sha256 else {}),
            **({"image": baseline.image} if baseline.image is not None else {}),
            **({"lock": digest_of(baseline.lock)} if baseline.lock is not None else {}),
            "manifest_digest": manifest.digest(),
            "env_id": env_id,
            "fresh_env": True,
            "cleanroom_version": __version__,
            "cleanroom_revision": cleanroom_revision(),
            **{k: v for k, v in facts.items() if v is not None},
            "host": host_facts(),
        },
        "timings": {
            **clock.phases,
            "started_at": clock.started_at,
            "ended_at": time.time(),
            "phases": {name: dict(span) for name, span in clock.spans.items()},
        },
    }
    if manifest.group is not None:  # provenance.group says how its shared setup was made
        record["group"] = manifest.group.id
    record["attestation"] = f"{folder}/{attest.ATTESTATION}"
    store.put_bytes(run_id, eid, record["attestation"], _envelope(record, signing_key))
    store.put_record(run_id, eid, record)
    return record


def _envelope(record: dict[str, Any], signing_key: Path | None) -> bytes:
    """The record's episode statement, signed (an unusable key fails the export, named)."""
    try:
        key = keys.signing_key(signing_key)
    except EvidenceError as exc:
        raise ExportError(f"cannot sign the attestation: {exc}") from exc
    return attest.sign(episode_statement(record, record_bytes(record)), key)


def export_attempt(
    store: Store,
    run_id: str,
    manifest: Manifest,
    attempt: int,
    env_id: str,
    outcome: Outcome,
    error: str | None,
    output: EpisodeOutput | None,
    diagnostics: dict[str, bytes],
    redactor: Redactor | None = None,
) -> None:
    """Keep the diagnostics of an attempt that did not reach a final outcome."""
    eid = manifest.episode_id
    diagnostics = redact_output(output, diagnostics, redactor)
    error = redactor.redact_text(error) if redactor and error else error
    folder = attempt_dir(attempt)
    logs = _put_logs(store, run_id, eid, folder, output, diagnostics)
    summary = {
        "episode_id": eid,
        "attempt": attempt,
        "env_id": env_id,
        "outcome": outcome.value,
        "error": error,
        "logs": logs,
        "secrets": secrets_summary(manifest, redactor),
    }
    store.put_bytes(run_id, eid, f"{folder}/attempt.json", json.dumps(summary, indent=1).encode())
