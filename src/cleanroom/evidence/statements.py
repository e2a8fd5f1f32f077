"""The three statements cleanroom signs (``attest``'s docstring): what each says, built here.

Pure functions over a record, a destroy proof or a run's chain; the signing and the store
writes are the caller's (``export``, the env's lease, ``ledger.seal``).
"""

from __future__ import annotations

from typing import Any

from cleanroom.core.version import __version__
from cleanroom.evidence.attest import (
    CHAIN,
    DESTROY,
    DESTROY_ENVELOPE,
    EPISODE,
    sha256,
    statement,
    subject,
)
from cleanroom.store.base import RECORD

TRANSCRIPT_LOG = "transcript.jsonl"


def files_of(record: dict[str, Any]) -> list[tuple[str, str]]:
    """Every (stored path, sha256) the record lists: its artifacts, then its logs."""
    out = []
    for kind in ("artifacts", "logs"):
        for entry in record.get(kind) or []:
            path = entry.get("path") or f"{kind}/{entry['name']}"
            out.append((str(path), str(entry["sha256"])))
    return out


def episode_statement(record: dict[str, Any], record_bytes: bytes) -> dict[str, Any]:
    """The episode statement over ``record_bytes`` (the record exactly as stored)."""
    prov = record.get("provenance") or {}
    folder = record.get("evidence") or f"attempts/{record.get('attempt')}"
    transcript = next(
        (e for e in record.get("logs") or [] if e.get("name") == TRANSCRIPT_LOG), None
    )
    subjects = [subject(RECORD, sha256(record_bytes))]
    subjects += [subject(path, digest) for path, digest in files_of(record)]
    predicate = {
        "run_id": record.get("run_id"),
        "episode_id": record.get("episode_id"),
        "attempt": record.get("attempt"),
        "baseline": {
            "digest": prov.get("baseline"),
            "name": prov.get("baseline_name"),
            "spec_digest": prov.get("spec_digest"),
            "lock": prov.get("lock"),
        },
        "manifest_digest": prov.get("manifest_digest"),
        "driver": {
            "name": prov.get("driver"),
            "accelerator": prov.get("accelerator"),
            "isolation": prov.get("isolation"),
        },
        "env": {
            "id": prov.get("env_id"),
            "fresh": prov.get("fresh_env"),
            "start": prov.get("start"),
            "template": prov.get("template"),
            "group": prov.get("group"),  # a clone: which warm snapshot (its digest) it came from
            "branch": prov.get("branch"),
        },
        "outcome": record.get("outcome"),
        "verdict": record.get("verdict"),
        "transcript": {"sha256": transcript["sha256"]} if transcript else None,
        "destroy": {
            "proof": f"{folder}/destroy.json",
            "statement": f"{folder}/{DESTROY_ENVELOPE}",
            "after_record": True,  # the env is destroyed once this record is durable
        },
        "cleanroom": {
            "version": prov.get("cleanroom_version", __version__),
            "revision": prov.get("cleanroom_revision"),
        },
    }
    return statement(EPISODE, subjects, predicate)


def destroy_statement(
    proof_path: str,
    proof_bytes: bytes,
    *,
    run_id: str,
    episode_id: str,
    attempt: int | None,
    env_id: str,
    confirmed_absent: bool,
) -> dict[str, Any]:
    return statement(
        DESTROY,
        [subject(proof_path, sha256(proof_bytes))],
        {
            "run_id": run_id,
            "episode_id": episode_id,
            "attempt": attempt,
            "env_id": env_id,
            "confirmed_absent": confirmed_absent,
            "cleanroom": {"version": __version__},
        },
    )


def chain_statement(
    run_id: str,
    events_path: str,
    events_bytes: bytes,
    count: int,
    head: str | None,
    node: str | None = None,
) -> dict[str, Any]:
    pred = {"run_id": run_id, "events": count, "head": head, "cleanroom": {"version": __version__}}
    return statement(
        CHAIN,
        [subject(events_path, sha256(events_bytes))],
        {**pred, **({"node": node} if node is not None else {})},
    )
