"""Secrets: providers resolve at launch; redaction finds every occurrence, even across chunks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cleanroom import secrets
from cleanroom.errors import ConfigError
from cleanroom.secrets import Redactor, provider_from, resolve


def test_env_file_and_command_providers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X_TOKEN", "from-env-123")
    assert resolve(provider_from("env:X_"), ["TOKEN"]) == {"TOKEN": "from-env-123"}
    f = tmp_path / "s.env"
    f.write_text("# comment\nTOKEN = from-file-456\n")
    assert resolve(provider_from(f"file:{f}"), ["TOKEN"]) == {"TOKEN": "from-file-456"}
    script = tmp_path / "vault.sh"
    script.write_text('#!/bin/sh\necho "cmd-$1-789"\n')
    script.chmod(0o755)
    assert resolve(provider_from(f"cmd:{script}"), ["TOKEN"]) == {"TOKEN": "cmd-TOKEN-789"}


def test_missing_and_short_secrets_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE", raising=False)
    with pytest.raises(ConfigError, match="NOPE"):
        resolve(provider_from("env"), ["NOPE"])
    monkeypatch.setenv("TINY", "ab")
    with pytest.raises(ConfigError, match="shorter"):
        resolve(provider_from("env"), ["TINY"])
    with pytest.raises(ConfigError):
        provider_from("ftp:x")


def test_redact_bytes_counts_each_occurrence() -> None:
    r = Redactor({"A": "s3cr3t-value", "B": "s3cr3t"})
    out = r.redact(b"x s3cr3t-value y s3cr3t z s3cr3t-value")
    assert out == b"x [REDACTED:A] y [REDACTED:B] z [REDACTED:A]"
    assert r.counts == {"A": 2, "B": 1}


def test_redact_file_across_chunk_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(secrets, "CHUNK", 7)  # tiny chunks: most secrets straddle a boundary
    value = "tok-ABCDEFGHIJ"
    body = ("noise " * 3 + value + "\n") * 25 + value
    path = tmp_path / "log"
    path.write_text(body)
    r = Redactor({"T": value})
    r.file(path)
    text = path.read_text()
    assert value not in text and text.count("[REDACTED:T]") == 26 == r.counts["T"]
    assert text == body.replace(value, "[REDACTED:T]")
    assert not list(tmp_path.glob("*.redacting"))


def test_random_bytes_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(secrets, "CHUNK", 13)
    value = os.urandom(16).hex()
    data = os.urandom(500) + value.encode() + os.urandom(77) + value.encode()
    path = tmp_path / "blob"
    path.write_bytes(data)
    Redactor({"K": value}).file(path)
    assert path.read_bytes() == data.replace(value.encode(), b"[REDACTED:K]")
