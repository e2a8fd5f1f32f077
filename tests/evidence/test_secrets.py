"""Secrets: providers resolve at launch; redaction finds every occurrence, even across chunks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cleanroom.errors import ConfigError
from cleanroom.evidence import secrets
from cleanroom.evidence.secrets import Redactor, provider_from, resolve


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
    monkeypatch.setenv("WEE", "abc")
    with pytest.raises(ConfigError, match=r"^secret\(s\) TINY, WEE shorter than 4 characters$"):
        resolve(provider_from("env"), ["WEE", "TINY"])
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


def test_file_provider_reads_json_and_env_lines_exactly(tmp_path: Path) -> None:
    """A JSON secrets file gives its values as text; an env file splits at the first ``=``
    only (a value may hold ``=``), skips comment lines, and a missing file or name is a
    ConfigError naming the file."""
    js = tmp_path / "s.json"
    js.write_text('{"TOKEN": "json-tok=1", "PORT": 8080}')
    assert resolve(provider_from(f"file:{js}"), ["PORT", "TOKEN"]) == {
        "PORT": "8080",
        "TOKEN": "json-tok=1",
    }
    lines = tmp_path / "s.env"
    lines.write_text("  # HIDDEN=commented-out\nKEY = a=b=c \nHIDDEN=\n")
    assert resolve(provider_from(f"file:{lines}"), ["KEY"]) == {"KEY": "a=b=c"}
    assert secrets.FileSecrets(lines).resolve(["HIDDEN"]) == {"HIDDEN": ""}  # the real line
    with pytest.raises(ConfigError, match=f"OTHER not found in {lines}"):
        resolve(provider_from(f"file:{lines}"), ["OTHER"])
    with pytest.raises(ConfigError, match=f"cannot read secrets file {tmp_path / 'absent'}"):
        resolve(provider_from(f"file:{tmp_path / 'absent'}"), ["KEY"])
    listed = tmp_path / "list.json"
    listed.write_text('["KEY"]')  # JSON, but not an object: no values at all
    with pytest.raises(ConfigError, match="KEY not found"):
        resolve(provider_from(f"file:{listed}"), ["KEY"])


def test_env_and_command_providers_fail_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each missing name is listed, the place is named (the prefix; the command), a command
    that exits non-zero is refused rather than read, and ``cmd:`` arguments may hold colons."""
    monkeypatch.delenv("P_A", raising=False)
    monkeypatch.delenv("P_B", raising=False)
    with pytest.raises(ConfigError, match=r"secret\(s\) A, B not found in .*prefix 'P_'"):
        resolve(provider_from("env:P_"), ["B", "A"])
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\necho leaked-value\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(ConfigError, match="secret command failed for TOKEN"):
        resolve(provider_from(f"cmd:{failing}"), ["TOKEN"])
    echo = tmp_path / "echo.sh"
    echo.write_text('#!/bin/sh\necho "$1=$2"\n')
    echo.chmod(0o755)
    assert resolve(provider_from(f"cmd:{echo} x:y"), ["TOKEN"]) == {"TOKEN": "x:y=TOKEN"}
    monkeypatch.setenv("PLAIN", "plain-value")
    assert resolve(provider_from("env"), ["PLAIN"]) == {"PLAIN": "plain-value"}
    assert resolve(provider_from(None), ["PLAIN"]) == {"PLAIN": "plain-value"}
    with pytest.raises(ConfigError, match=r"--secrets-from must be .*'ENV'"):
        provider_from("ENV")


def test_a_hanging_secret_command_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret command that never answers is killed after its timeout (30 s; shortened here),
    and the episode gets a ConfigError instead of a controller that waits forever."""
    real_run = secrets.subprocess.run
    seen: dict[str, object] = {}

    def run(*args: object, **kwargs: object) -> object:
        seen.update(kwargs)
        kwargs["timeout"] = 0.5
        return real_run(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(secrets.subprocess, "run", run)
    slow = tmp_path / "slow.sh"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    with pytest.raises(ConfigError, match="secret command failed for T"):
        resolve(provider_from(f"cmd:{slow}"), ["T"])
    assert seen["timeout"] == 30 and seen["check"] is True
