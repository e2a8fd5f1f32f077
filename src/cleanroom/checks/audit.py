"""``cleanroom audit verify``: check a run's evidence without trusting the machine that wrote it.

Reads only the store (any copy of it: a folder, ``s3://``) and the public keys it is given:

1. **the chain**: ``ledger/head.dsse.json`` is signed by a trusted key and names this run; its
   subject is the stored ``ledger/events.jsonl``; every link holds (``ledger.chain``); the
   count and the last hash are the head's (so no event was dropped from the end either). A Ray
   run's chain names each node's sealed part (``node_chain``): each is checked the same way at
   ``ledger/nodes/<node>/``, must end where the run's chain says, and adds its envs.
2. **the envs** (from the chain): every env the run made was destroyed and confirmed absent;
   no env was made twice, none served two episodes.
3. **the outcomes**: every final outcome in the chain (completed, episode_error, timeout) has
   its record, of that attempt and outcome; every record has its outcome in the chain.
4. **each record**: its episode statement is signed by a trusted key and names this run,
   episode and attempt; the record's stored bytes and every artifact and log it lists match
   the statement's digests; its env is the one the chain made for that attempt, and no other
   record names it; its destroy statement is signed, over the stored ``destroy.json``, and
   says that env was confirmed absent.

The first problem found is the first broken link; all are kept (``AuditReport.problems``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cleanroom.core.states import Outcome
from cleanroom.errors import EvidenceError, StoreError
from cleanroom.evidence import attest
from cleanroom.evidence.attest import sha256, subjects_of
from cleanroom.evidence.seal import NODE_CHAIN, RunFiles, chain_paths
from cleanroom.evidence.statements import files_of
from cleanroom.ledger import chain
from cleanroom.store import RECORD
from cleanroom.store.layout import attempt_dir

FINAL = {o.value for o in Outcome if o.final}


@dataclass
class AuditReport:
    run_id: str
    problems: list[str] = field(default_factory=list)
    events: int = 0
    envs: int = 0
    records: int = 0
    status: dict[str, str] = field(default_factory=dict)  # episode -> "verified" | its problem

    @property
    def ok(self) -> bool:
        return not self.problems

    def broken(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")


@dataclass
class _Chain:
    """What the run's chain says: which env each attempt had, and how each ended."""

    intents: dict[str, list[tuple[str | None, int | None]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    absent: dict[str, bool] = field(default_factory=dict)
    finished: dict[tuple[str, Any], str] = field(default_factory=dict)  # (episode, attempt)


def verify_run(store: Any, run_id: str, keys: list[Ed25519PublicKey]) -> AuditReport:
    """Every check above over ``run_id`` in ``store`` (a ``BaseStore``)."""
    report = AuditReport(run_id)
    told = _verify_chain(store, run_id, keys, report)
    if told is not None:
        _verify_envs(told, report)
    _verify_records(store, run_id, keys, told, report)
    return report


def _verify_chain(
    store: Any, run_id: str, keys: list[Ed25519PublicKey], report: AuditReport
) -> _Chain | None:
    if not isinstance(store, RunFiles):
        report.broken(f"run {run_id} ledger chain", "this store keeps no run-level files")
        return None
    events = _signed_chain(store, run_id, None, keys, report)
    if events is None:
        return None
    report.events = len(events)
    told, seen = _Chain(), {e["hash"] for e in events}
    for event in events:
        _fold(told, event, env_only=False)
    for event in events:  # a Ray run: each node's part of the chain, as the driver recorded it
        if event["kind"] != NODE_CHAIN:
            continue
        link = json.loads(event["data"])
        node = str(link.get("node"))
        part = _signed_chain(store, run_id, node, keys, report)
        if part is None:
            return None
        if (len(part), part[-1]["hash"] if part else None) != (
            link.get("events"),
            link.get("head"),
        ):
            report.broken(
                f"run {run_id} node {node} chain",
                f"ends at event {len(part)}, the run's chain says {link.get('events')}",
            )
            return None
        for e in part:
            if e["hash"] not in seen:  # a node whose ledger is the driver's holds both
                seen.add(e["hash"])
                _fold(told, e, env_only=True)
    return told


def _signed_chain(
    store: Any, run_id: str, node: str | None, keys: list[Ed25519PublicKey], report: AuditReport
) -> list[dict[str, Any]] | None:
    """The run's chain (or ``node``'s part), checked: its head signed by a trusted key and
    naming this run (and node), every link, its count and last hash, its digest."""
    events_path, head_path = chain_paths(node)
    where = f"run {run_id} ledger chain" + (f" of node {node}" if node else "")
    raw_head = store.get_run_bytes(run_id, head_path)
    raw = store.get_run_bytes(run_id, events_path)
    if raw_head is None or raw is None:
        report.broken(where, f"missing ({head_path} and {events_path}): the run was never sealed")
        return None
    try:
        stmt = attest.open_envelope(raw_head, keys, head_path)
        subjects = subjects_of(stmt)
    except EvidenceError as exc:
        report.broken(where, f"head: {exc}")
        return None
    pred = stmt.get("predicate") or {}
    if stmt.get("predicateType") != attest.CHAIN or pred.get("run_id") != run_id:
        report.broken(where, f"the signed head is of run {pred.get('run_id')!r}, not this run")
        return None
    if pred.get("node") != node:
        report.broken(where, f"the signed head is of node {pred.get('node')!r}")
        return None
    try:
        events = list(chain.parse(raw))
    except ValueError as exc:
        report.broken(where, f"{events_path} does not parse: {exc}")
        return None
    bad = chain.broken_link(events)
    if bad is not None:
        report.broken(where, bad[1])
        return None
    tip = events[-1]["hash"] if events else None
    if len(events) != pred.get("events") or tip != pred.get("head"):
        ends, signed = (
            (len(events), str(tip)[:12]),
            (pred.get("events"), str(pred.get("head"))[:12]),
        )
        report.broken(where, f"the chain ends at event {ends}, its signed head at {signed}")
        return None
    if subjects.get(events_path) != sha256(raw):
        report.broken(where, f"{events_path} does not match its signed digest")
        return None
    for event in events:
        if event["run_id"] != run_id:
            report.broken(where, f"event {event['seq']} belongs to run {event['run_id']!r}")
            return None
    return events


def _fold(told: _Chain, event: dict[str, Any], *, env_only: bool) -> None:
    """What ``event`` tells of the run's envs (and, unless ``env_only``, of its outcomes: a
    node's part names its attempts' ends as the node saw them; the driver's are the run's)."""
    data = json.loads(event["data"])
    kind, env, eid = event["kind"], event["env_id"], event["episode_id"]
    if kind == "env_intent" and env:
        told.intents[env].append((eid, data.get("attempt")))
    elif kind == "env_destroyed" and env:
        told.absent[env] = bool(data.get("confirmed_absent"))
    elif kind == "episode_finished" and eid and not env_only:
        told.finished[(eid, data.get("attempt"))] = str(data.get("outcome"))


def _verify_envs(told: _Chain, report: AuditReport) -> None:
    report.envs = len(told.intents)
    for env, uses in sorted(told.intents.items()):
        if len(uses) > 1:
            report.broken(
                f"env {env}", f"made {len(uses)} times (for {uses}): an env is never reused"
            )
        if not told.absent.get(env):
            state = "never destroyed" if env not in told.absent else "not confirmed absent"
            report.broken(f"env {env}", f"{state} in the ledger chain")


def _verify_records(
    store: Any, run_id: str, keys: list[Ed25519PublicKey], told: _Chain | None, report: AuditReport
) -> None:
    try:
        episodes = store.episode_ids(run_id)
    except StoreError as exc:
        report.broken(f"run {run_id}", f"cannot list its episodes: {exc}")
        return
    env_of: dict[str, str] = {}
    durable: set[tuple[str, int]] = set()
    for eid in episodes:
        before = len(report.problems)
        found = _verify_record(store, run_id, eid, keys, told, env_of, report)
        if found is not None:
            durable.add(found)
            report.records += 1
        if found is not None or len(report.problems) > before:
            report.status[eid] = (
                "verified" if len(report.problems) == before else report.problems[before]
            )
    if told is None:
        return
    for (eid, attempt), outcome in sorted(told.finished.items()):
        if outcome in FINAL and (eid, attempt) not in durable:
            report.broken(f"episode {eid}", f"ended {outcome} (attempt {attempt}) with no record")
            report.status.setdefault(eid, report.problems[-1])


def _verify_record(
    store: Any,
    run_id: str,
    eid: str,
    keys: list[Ed25519PublicKey],
    told: _Chain | None,
    env_of: dict[str, str],
    report: AuditReport,
) -> tuple[str, int] | None:
    """One episode folder's record and statements; (episode, attempt) if it has a record."""
    where = f"episode {eid}"
    raw = store.get_bytes(run_id, eid, RECORD)
    if raw is None:
        return None  # no final outcome (yet): the chain says whether one is missing
    try:
        record = json.loads(raw)
        attempt = int(record["attempt"])
        path = str(record["attestation"])
    except (ValueError, KeyError, TypeError) as exc:
        report.broken(where, f"{RECORD} is unreadable or names no attestation ({exc})")
        return None
    env = (record.get("provenance") or {}).get("env_id")
    envelope = store.get_bytes(run_id, eid, path)
    if envelope is None:
        report.broken(where, f"its attestation {path} is missing from the store")
        return (eid, attempt)
    try:
        stmt = attest.open_envelope(envelope, keys, path)
        subjects = subjects_of(stmt)
    except EvidenceError as exc:
        report.broken(where, str(exc))
        return (eid, attempt)
    pred = stmt.get("predicate") or {}
    named = (pred.get("run_id"), pred.get("episode_id"), pred.get("attempt"))
    if stmt.get("predicateType") != attest.EPISODE or named != (run_id, eid, attempt):
        report.broken(where, f"its signed statement is of run/episode/attempt {named}")
        return (eid, attempt)
    if subjects.get(RECORD) != sha256(raw):
        report.broken(where, f"{RECORD} does not match its signed digest")
        return (eid, attempt)
    if (record.get("run_id"), record.get("episode_id")) != (run_id, eid):
        report.broken(where, f"the record is of {record.get('run_id')}/{record.get('episode_id')}")
    listed = dict(files_of(record))
    files = sorted((n, d) for n, d in subjects.items() if n != RECORD)
    for name, digest in files:
        data = store.get_bytes(run_id, eid, name)
        if data is None:
            report.broken(where, f"{name} is missing from the store")
        elif sha256(data) != digest:
            report.broken(where, f"{name} does not match its signed digest")
    for name in sorted(set(listed) - set(subjects)):
        report.broken(where, f"{name} is listed by the record but not signed")
    _verify_env(store, run_id, eid, attempt, env, pred, keys, told, env_of, report)
    if told is not None and told.finished.get((eid, attempt)) != record.get("outcome"):
        said = told.finished.get((eid, attempt))
        report.broken(where, f"the record says {record.get('outcome')}, the ledger chain {said}")
    return (eid, attempt)


def _verify_env(
    store: Any,
    run_id: str,
    eid: str,
    attempt: int,
    env: Any,
    pred: dict[str, Any],
    keys: list[Ed25519PublicKey],
    told: _Chain | None,
    env_of: dict[str, str],
    report: AuditReport,
) -> None:
    """The record's env: the statement's, the chain's for this attempt, nobody else's, gone."""
    where = f"episode {eid}"
    if not isinstance(env, str) or (pred.get("env") or {}).get("id") != env:
        report.broken(where, f"its env {env!r} is not the one its statement names")
        return
    if env in env_of:
        report.broken(where, f"env {env} also served episode {env_of[env]}: an env is never reused")
    env_of.setdefault(env, eid)
    if told is not None and (eid, attempt) not in told.intents.get(env, []):
        report.broken(where, f"env {env} was not made for attempt {attempt} in the ledger chain")
    proof_path = f"{attempt_dir(attempt)}/destroy.json"  # where the env's lease writes them
    stmt_path = f"{attempt_dir(attempt)}/{attest.DESTROY_ENVELOPE}"
    proof, envelope = (
        store.get_bytes(run_id, eid, proof_path),
        store.get_bytes(run_id, eid, stmt_path),
    )
    if envelope is None:
        report.broken(where, f"its destroy statement {stmt_path} is missing from the store")
        return
    try:
        stmt = attest.open_envelope(envelope, keys, stmt_path)
    except EvidenceError as exc:
        report.broken(where, f"destroy statement: {exc}")
        return
    dpred = stmt.get("predicate") or {}
    if proof is None or subjects_of(stmt).get(proof_path) != sha256(proof):
        report.broken(where, f"{proof_path} does not match its signed destroy statement")
    elif (dpred.get("run_id"), dpred.get("episode_id"), dpred.get("env_id")) != (run_id, eid, env):
        report.broken(where, f"its destroy statement is of another env or episode ({dpred})")
    elif dpred.get("confirmed_absent") is not True:
        report.broken(where, f"env {env} was not confirmed absent")
