"""The signing key (made 0600 on first use, or the user's) and DSSE's encoding."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cleanroom.errors import EvidenceError, SignatureError
from cleanroom.evidence import attest, keys


def test_pae_is_the_dsse_specs() -> None:
    # the DSSE spec's own example (protocol.md)
    assert attest.pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


def test_the_homes_key_is_made_private_on_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(keys.KEY_ENV, raising=False)
    key = keys.signing_key()
    path = keys.home_key_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = keys.signing_key()  # the same key, not a new one
    assert keys.key_id(again.public_key()) == keys.key_id(key.public_key())
    pem = tmp_path / "pub.pem"
    pem.write_bytes(keys.public_pem(key.public_key()))
    assert keys.key_id(keys.load_public(pem)) == keys.key_id(key.public_key())


def test_a_users_key_signs_and_a_wrong_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = Ed25519PrivateKey.generate()
    path = tmp_path / "mine.pem"
    path.write_bytes(
        mine.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    monkeypatch.setenv(keys.KEY_ENV, str(path))
    assert keys.key_id(keys.signing_key().public_key()) == keys.key_id(mine.public_key())
    stmt = attest.statement("https://x/v1", [attest.subject("f", "00")], {"a": 1})
    envelope = attest.sign(stmt, keys.signing_key())
    assert attest.open_envelope(envelope, [mine.public_key()], "e") == stmt
    body = json.loads(envelope)
    assert body["signatures"][0]["keyid"] == keys.key_id(mine.public_key())
    with pytest.raises(SignatureError, match="no trusted key signed it"):
        attest.open_envelope(envelope, [Ed25519PrivateKey.generate().public_key()], "e")
    body["payload"] = base64.b64encode(b'{"_type": "other"}').decode()  # payload swapped
    with pytest.raises(SignatureError):
        attest.open_envelope(json.dumps(body).encode(), [mine.public_key()], "e")
    with pytest.raises(EvidenceError, match="not a DSSE envelope"):
        attest.open_envelope(b"{}", [mine.public_key()], "e")
    ec = tmp_path / "ec.pem"
    ec.write_bytes(
        generate_private_key(SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(EvidenceError, match="not an ed25519 key"):
        keys.signing_key(ec)


def test_an_envelope_that_is_not_an_in_toto_statement_is_refused() -> None:
    key = Ed25519PrivateKey.generate()
    trusted = [key.public_key()]

    def signed(payload: bytes, kind: str = attest.PAYLOAD_TYPE) -> bytes:
        sig = key.sign(attest.pae(kind, payload))
        return json.dumps(
            {
                "payload": base64.b64encode(payload).decode(),
                "payloadType": kind,
                "signatures": [{"keyid": "k", "sig": base64.b64encode(sig).decode()}],
            }
        ).encode()

    with pytest.raises(EvidenceError, match="payloadType 'text/plain', not application/vnd"):
        attest.open_envelope(signed(b"{}", "text/plain"), trusted, "e")
    with pytest.raises(EvidenceError, match="e: the payload is not JSON"):
        attest.open_envelope(signed(b"not json"), trusted, "e")
    with pytest.raises(EvidenceError, match="e: the payload is not an in-toto Statement v1"):
        attest.open_envelope(
            signed(b'{"_type": "https://in-toto.io/Statement/v0.1"}'), trusted, "e"
        )
    with pytest.raises(EvidenceError, match="e: the payload is not an in-toto Statement v1"):
        attest.open_envelope(signed(b"[1]"), trusted, "e")
    stmt = {"_type": attest.STATEMENT_TYPE, "subject": [{"name": "x"}]}
    assert attest.open_envelope(signed(json.dumps(stmt).encode()), trusted, "e") == stmt
    with pytest.raises(EvidenceError, match="a malformed subject"):
        attest.subjects_of(stmt)
    assert attest.subjects_of({"subject": [attest.subject("f", "ab")]}) == {"f": "ab"}


def test_the_payload_is_the_statements_canonical_json_and_nan_is_refused() -> None:
    key = Ed25519PrivateKey.generate()
    stmt = attest.statement("https://x/v1", [attest.subject("f", "00")], {"b": 1, "a": [1.5]})
    raw = attest.sign(stmt, key)
    envelope = json.loads(raw)
    payload = base64.b64decode(envelope["payload"])
    assert payload == (
        b'{"_type":"https://in-toto.io/Statement/v1","predicate":{"a":[1.5],"b":1},'
        b'"predicateType":"https://x/v1","subject":[{"digest":{"sha256":"00"},"name":"f"}]}'
    )
    assert raw.startswith(b'{\n "payload": "') and raw.endswith(b"\n}\n")  # one key a line
    assert attest.sign(stmt, key) == raw  # ed25519 is deterministic: a re-export is a no-op
    with pytest.raises(ValueError, match="not JSON compliant"):
        attest.sign({**stmt, "predicate": {"x": float("nan")}}, key)


def test_base64_outside_the_alphabet_is_refused_and_the_signer_is_named() -> None:
    key = Ed25519PrivateKey.generate()
    stmt = attest.statement("https://x/v1", [], {})
    envelope = json.loads(attest.sign(stmt, key))
    for field in ("payload", "sig"):
        bad = json.loads(json.dumps(envelope))
        if field == "payload":
            bad["payload"] = "!" + bad["payload"]
        else:
            bad["signatures"][0]["sig"] = "!" + bad["signatures"][0]["sig"]
        with pytest.raises(EvidenceError, match="not a DSSE envelope"):
            attest.open_envelope(json.dumps(bad).encode(), [key.public_key()], "e")
    other = Ed25519PrivateKey.generate().public_key()
    kid = keys.key_id(key.public_key())[:16]
    with pytest.raises(SignatureError, match=rf"signed by key \['{kid}'\]\)$"):
        attest.open_envelope(json.dumps(envelope).encode(), [other], "e")
    del envelope["signatures"][0]["keyid"]
    with pytest.raises(SignatureError, match=r"signed by key \['\?'\]\)$"):
        attest.open_envelope(json.dumps(envelope).encode(), [other], "e")
