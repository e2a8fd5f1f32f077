"""Move an episode's staged evidence into the durable store, the result record last.

``export_episode`` is for final outcomes: artifacts and logs first (each confirmed by the store),
then ``result.json``; only after that is the episode durable. ``export_attempt`` keeps what can
be had of a non-final attempt (logs, console tail, the error) under ``attempts/<n>/``.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from cleanroom import __version__
from cleanroom.agent.session import Artifact, EpisodeOutput
from cleanroom.baseline.model import Baseline
from cleanroom.digests import digest_of, sha256_file
from cleanroom.errors import ExportError
from cleanroom.manifest import Manifest
from cleanroom.record import Outcome, cleanroom_revision, host_facts, parse_guest_result
from cleanroom.secrets import Redactor
from cleanroom.store import Store

if TYPE_CHECKING:
    from cleanroom.episode_clock import EpisodeClock

RECORD_VERSION = 1


def redact_output(
    output: EpisodeOutput | None, diagnostics: dict[str, bytes], redactor: Redactor | None
) -> dict[str, bytes]:
    """Replace secret values in everything staged (files in place); return clean diagnostics."""
    if not redactor:
        return diagnostics
    if output is not None:
        for path in (output.stdout_path, output.stderr_path):
            if path is not None and path.exists():
                redactor.file(path)
        artifacts = []
        for artifact in output.artifacts:
            redactor.file(artifact.path)
            artifacts.append(
                Artifact(
                    artifact.name,
                    artifact.path.stat().st_size,
                    sha256_file(artifact.path),
                    artifact.path,
                )
            )
        output.artifacts = artifacts
        if output.result_raw is not None:
            output.result_raw = redactor.redact(output.result_raw)
    return {name: redactor.redact(data) for name, data in diagnostics.items()}


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
    prefix: str,
    output: EpisodeOutput | None,
    diagnostics: dict[str, bytes],
) -> list[dict[str, Any]]:
    logs = []
    if output is not None:
        for path in (output.stdout_path, output.stderr_path):
            if path is not None and path.exists():
                stored = store.put_file(run_id, eid, f"{prefix}logs/{path.name}", path)
                logs.append({"name": path.name, "size": stored.size, "sha256": stored.sha256})
    for name, data in sorted(diagnostics.items()):
        stored = store.put_bytes(run_id, eid, f"{prefix}logs/{name}", data)
        logs.append({"name": name, "size": stored.size, "sha256": stored.sha256})
    return logs


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
) -> dict[str, Any]:
    """Write artifacts, logs, then the record (with the verifier's ``verdict``, if any).
    Raises StoreError; returns the record."""
    eid = manifest.episode_id
    diagnostics = redact_output(output, diagnostics, redactor)
    error = redactor.redact_text(error) if redactor and error else error
    artifacts = []
    for artifact in output.artifacts:
        stored = store.put_file(run_id, eid, f"artifacts/{artifact.name}", artifact.path)
        if stored.sha256 != artifact.sha256:
            raise ExportError(f"artifact {artifact.name}: stored bytes differ from what arrived")
        artifacts.append({"name": artifact.name, "size": stored.size, "sha256": stored.sha256})
    logs = _put_logs(store, run_id, eid, "", output, diagnostics)
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
        "artifacts": artifacts,
        "logs": logs,
        "secrets": secrets_summary(manifest, redactor),
        "provenance": {
            "baseline": baseline.digest,
            "baseline_name": baseline.name,
            "spec_digest": baseline.spec_digest,
            "kernel": baseline.kernel_version,
            "agent_version": baseline.agent_version,
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
    store.put_record(run_id, eid, record)
    return record


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
    prefix = f"attempts/{attempt}/"
    logs = _put_logs(store, run_id, eid, prefix, output, diagnostics)
    summary = {
        "episode_id": eid,
        "attempt": attempt,
        "env_id": env_id,
        "outcome": outcome.value,
        "error": error,
        "logs": logs,
        "secrets": secrets_summary(manifest, redactor),
    }
    store.put_bytes(run_id, eid, prefix + "attempt.json", json.dumps(summary, indent=1).encode())
