"""Redaction of what is *meant* (issue 15 §4): a secret hidden as JSON ``\\u`` escapes, URL
encoding or base64, or used as an artifact's name, never reaches the staged evidence, and the
counts say how many replacements were made. On the old code (raw-byte matching before JSON
decoding) the escaped secret, the artifact name and the base64 form all stayed in clear."""

from __future__ import annotations

import base64
import json
import urllib.parse
from pathlib import Path

import pytest

from cleanroom.agent.connection import Artifact, EpisodeOutput, ExecResult
from cleanroom.evidence import secrets
from cleanroom.evidence.export import redact_output
from cleanroom.evidence.record import parse_guest_result
from cleanroom.evidence.secrets import Redactor
from cleanroom.host.digests import sha256_file

SECRET = "hf_Sup3r/Secret+Tok"


def escaped(text: str, upper: bool = False) -> str:
    return "".join((f"\\u{ord(c):04X}" if upper else f"\\u{ord(c):04x}") for c in text)


def staged(tmp: Path, result: bytes, artifacts: dict[str, bytes], stdout: bytes) -> EpisodeOutput:
    (tmp / "logs").mkdir(parents=True)
    (tmp / "logs" / "stdout.log").write_bytes(stdout)
    found = []
    for name, data in artifacts.items():
        path = tmp / "artifacts" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        found.append(Artifact(name, len(data), sha256_file(path), path))
    return EpisodeOutput(
        exit=ExecResult(0, None, b"", b"", 0.1, False),
        artifacts=found,
        result_raw=result,
        stdout_path=tmp / "logs" / "stdout.log",
    )


def no_secret_under(tmp: Path) -> None:
    for path in tmp.rglob("*"):
        assert SECRET not in str(path), path
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_escaped_secret_in_result_json_is_redacted_key_and_value(tmp_path: Path) -> None:
    key, value = escaped(SECRET), escaped(SECRET, upper=True)
    raw = ('{"reward": 1, "info": {"' + key + '": "' + value + '"}}').encode()
    output = staged(tmp_path, raw, {}, b"")
    redactor = Redactor({"HF": SECRET})
    redact_output(output, {}, redactor)
    guest = parse_guest_result(output.result_raw)
    assert guest.problem is None and guest.info == {"[REDACTED:HF]": "[REDACTED:HF]"}
    assert SECRET not in json.dumps(guest.info, ensure_ascii=False)
    assert redactor.counts == {"HF": 2}


def test_artifact_named_after_a_secret_is_renamed(tmp_path: Path) -> None:
    names = {f"{SECRET}.txt": b"a", f"d/{SECRET}/x.txt": b"b", "plain.txt": b"c"}
    output = staged(tmp_path, b'{"reward": 1}', names, b"")
    redactor = Redactor({"HF": SECRET})
    redact_output(output, {}, redactor)
    by_name = {a.name: a for a in output.artifacts}
    assert set(by_name) == {"[REDACTED:HF].txt", "d/[REDACTED:HF]/x.txt", "plain.txt"}
    assert by_name["d/[REDACTED:HF]/x.txt"].path.read_bytes() == b"b"
    assert redactor.counts == {"HF": 2}
    no_secret_under(tmp_path)


def test_encoded_forms_in_logs_are_redacted_and_counted(tmp_path: Path) -> None:
    forms = [
        SECRET,
        base64.b64encode(SECRET.encode()).decode(),
        base64.b64encode(b"x" + SECRET.encode()).decode(),  # another alignment
        base64.urlsafe_b64encode(b"xy" + SECRET.encode()).decode(),
        urllib.parse.quote(SECRET, safe=""),
        "".join(f"%{byte:02x}" for byte in SECRET.encode()),  # every byte, lower-case hex
        escaped(SECRET),
        json.dumps(SECRET).replace("/", "\\/")[1:-1],
    ]
    log = "".join(f"line {i}: {form}\n" for i, form in enumerate(forms)).encode()
    output = staged(tmp_path, b'{"reward": 1}', {}, log)
    redactor = Redactor({"HF": SECRET})
    redact_output(output, {"console.log": log}, redactor)
    text = (tmp_path / "logs" / "stdout.log").read_text()
    assert text.count("[REDACTED:HF]") == len(forms), text
    for form in forms:
        assert form not in text
    assert redactor.counts == {"HF": 2 * len(forms)}  # the log file and the console


def test_a_secret_that_is_a_number_is_redacted_in_parsed_json(tmp_path: Path) -> None:
    output = staged(tmp_path, b'{"reward": 1, "metrics": {"pin": 73519426}}', {}, b"")
    redactor = Redactor({"PIN": "73519426"})
    redact_output(output, {}, redactor)
    assert parse_guest_result(output.result_raw).metrics == {"pin": "[REDACTED:PIN]"}


def test_invalid_json_is_still_redacted_as_bytes(tmp_path: Path) -> None:
    output = staged(tmp_path, ('{"reward": "' + escaped(SECRET)).encode(), {}, b"")
    redactor = Redactor({"HF": SECRET})
    redact_output(output, {}, redactor)
    assert output.result_raw == b'{"reward": "[REDACTED:HF]'


@pytest.mark.parametrize("chunk", [3, 7, 64])
def test_escaped_forms_split_across_file_chunks_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(secrets, "CHUNK", chunk)
    body = ("a" * 5 + escaped(SECRET) + "b" * 11 + SECRET + "c").encode()
    path = tmp_path / "f"
    path.write_bytes(body)
    redactor = Redactor({"HF": SECRET, "SHORT": "Sup3r"})
    redactor.file(path)
    assert path.read_bytes() == b"aaaaa[REDACTED:HF]bbbbbbbbbbb[REDACTED:HF]c"
    assert redactor.counts == {"HF": 2, "SHORT": 0}  # the longer secret is replaced whole


@pytest.mark.parametrize("chunk", [1, 2, 29, 58, 59, 64])
def test_overlapping_base64_at_a_chunk_boundary_is_one_span(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Protects streamed redaction where two overlapping base64 alignments of one secret
    straddle the point up to which a chunk is redacted: the span waits for the next chunk.
    Before, the first alignment alone was replaced and ``Q`` (six of the secret's bits) was
    left in clear at these chunk sizes."""
    monkeypatch.setattr(secrets, "CHUNK", chunk)
    path = tmp_path / "f"
    path.write_bytes(b"data:" + base64.b64encode(b"\0\0\0\t\t\t\t\x08") + b"." * 60)
    redactor = Redactor({"S": "\t\t\t\x08"})
    redactor.file(path)
    assert path.read_bytes() == b"data:AAAA[REDACTED:S]g=" + b"." * 60
    assert redactor.counts == {"S": 1}


def test_each_form_is_found_alone_in_plain_text() -> None:
    """The redactor searches only for the forms that can occur in a text (no ``%``/``\\``:
    no escaped form); each form alone, in otherwise plain text, is still found."""
    forms = [
        SECRET,
        base64.b64encode(b"ab" + SECRET.encode()).decode(),
        escaped(SECRET),
        urllib.parse.quote(SECRET, safe=""),
    ]
    for form in forms:
        redactor = Redactor({"HF": SECRET})
        assert redactor.redact(f"plain {form} text\n".encode()).count(b"[REDACTED:HF]") == 1
        assert redactor.counts == {"HF": 1}
