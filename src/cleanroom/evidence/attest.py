"""Attestations: in-toto Statements v1 in DSSE envelopes, signed with ed25519.

Three statements, each ``_type`` https://in-toto.io/Statement/v1, each subject a file of the
store by sha256 (its name: the path relative to its episode folder, or to the run folder):

- **episode** (``EPISODE``), ``attempts/<n>/attestation.dsse.json``, written just before the
  result record (the record is still the last write; the statement's subject is the record's
  exact stored bytes): the record, every artifact and log; the predicate names the baseline
  and lock digests, driver and accelerator, the env (its id, created for this episode, how it
  started: boot, spare, template or snapshot digest), outcome, verdict, the transcript's digest
  and cleanroom's version. The env is destroyed only after the record is durable (promise 3),
  so its destroy proof cannot be in this statement: the predicate names where it will be.
- **destroy** (``DESTROY``), ``attempts/<n>/destroy.dsse.json``, written by the env's lease
  once its absence is confirmed: ``destroy.json`` and the confirmation.
- **chain** (``CHAIN``), ``ledger/head.dsse.json`` in the run folder: the run's ledger events
  (``ledger/events.jsonl``) and the head of their hash chain (``cleanroom.ledger.chain``).

DSSE: the payload is the statement's canonical JSON, signed over
``PAE(type, payload) = "DSSEv1" SP len(type) SP type SP len(payload) SP payload``; the
envelope is ``{payload (base64), payloadType, signatures: [{keyid, sig (base64)}]}``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cleanroom.errors import EvidenceError, SignatureError
from cleanroom.evidence.keys import key_id

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
EPISODE = "https://cleanroom.dev/attestation/episode/v1"
DESTROY = "https://cleanroom.dev/attestation/destroy/v1"
CHAIN = "https://cleanroom.dev/attestation/ledger-chain/v1"
ATTESTATION = "attestation.dsse.json"  # beside the attempt's evidence
DESTROY_ENVELOPE = "destroy.dsse.json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what the signature is over."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def subject(name: str, digest_hex: str) -> dict[str, Any]:
    return {"name": name, "digest": {"sha256": digest_hex}}


def statement(
    predicate_type: str, subjects: list[dict[str, Any]], predicate: dict[str, Any]
) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": predicate_type,
        "predicate": predicate,
    }


def sign(stmt: dict[str, Any], key: Ed25519PrivateKey) -> bytes:
    """The statement in a DSSE envelope signed by ``key``: the bytes to store."""
    payload = json.dumps(stmt, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    sig = key.sign(pae(PAYLOAD_TYPE, payload))
    envelope = {
        "payload": base64.b64encode(payload).decode(),
        "payloadType": PAYLOAD_TYPE,
        "signatures": [{"keyid": key_id(key.public_key()), "sig": base64.b64encode(sig).decode()}],
    }
    return json.dumps(envelope, indent=1).encode() + b"\n"


def open_envelope(raw: bytes, keys: list[Ed25519PublicKey], where: str) -> dict[str, Any]:
    """The statement of a DSSE envelope once a signature by one of ``keys`` verifies.

    EvidenceError if the envelope does not parse; SignatureError if no trusted key signed it."""
    try:
        envelope = json.loads(raw)
        payload = base64.b64decode(envelope["payload"], validate=True)
        kind = envelope["payloadType"]
        signatures = envelope["signatures"]
        sigs = [base64.b64decode(s["sig"], validate=True) for s in signatures]
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise EvidenceError(f"{where}: not a DSSE envelope ({exc})") from exc
    if kind != PAYLOAD_TYPE:
        raise EvidenceError(f"{where}: payloadType {kind!r}, not {PAYLOAD_TYPE}")
    message = pae(kind, payload)
    if not any(_verifies(k, s, message) for k in keys for s in sigs):
        ids = [str(s.get("keyid", "?"))[:16] for s in signatures if isinstance(s, dict)]
        raise SignatureError(f"{where}: no trusted key signed it (signed by key {ids})")
    try:
        stmt = json.loads(payload)
    except ValueError as exc:
        raise EvidenceError(f"{where}: the payload is not JSON ({exc})") from exc
    if not isinstance(stmt, dict) or stmt.get("_type") != STATEMENT_TYPE:
        raise EvidenceError(f"{where}: the payload is not an in-toto Statement v1")
    return stmt


def _verifies(key: Ed25519PublicKey, sig: bytes, message: bytes) -> bool:
    try:
        key.verify(sig, message)
    except InvalidSignature:
        return False
    return True


def subjects_of(stmt: dict[str, Any]) -> dict[str, str]:
    """Subject name -> sha256 hex (EvidenceError for a malformed subject)."""
    out: dict[str, str] = {}
    for entry in stmt.get("subject") or []:
        try:
            out[str(entry["name"])] = str(entry["digest"]["sha256"])
        except (KeyError, TypeError) as exc:
            raise EvidenceError(f"a malformed subject: {entry!r}") from exc
    return out
