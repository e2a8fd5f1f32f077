"""Export of staged evidence (``export.py``): what a non-final attempt keeps, how a secret in an
artifact's name is renamed away, and the result record's redacted form (issue 21 §3: the
mutants these kill survived the suite before)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cleanroom.agent.connection import Artifact, EpisodeOutput, ExecResult
from cleanroom.core.states import Outcome
from cleanroom.evidence.export import _redact_result, _unique, export_attempt, redact_output
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.secrets import Redactor
from cleanroom.host.digests import sha256_file
from cleanroom.store import LocalStore

SECRET = "tok-Very-Secret-42"


def manifest() -> Manifest:
    return Manifest.model_validate(
        {"episode_id": "ep-1", "seed": 1, "policy": {"id": "p"}, "secrets": ["TOK"]}
    )


def artifact(root: Path, name: str, data: bytes) -> Artifact:
    path = root / "artifacts" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return Artifact(name, len(data), sha256_file(path), path)


def test_a_non_final_attempt_keeps_its_redacted_logs_error_and_summary(tmp_path: Path) -> None:
    """``attempts/<n>/attempt.json`` names the episode, attempt, env, outcome and the redacted
    error, lists each stored log with its true size and sha256, and says which secrets were
    redacted how often; no byte of the secret reaches the store."""
    staging = tmp_path / "staging"
    (staging / "logs").mkdir(parents=True)
    stdout = staging / "logs" / "stdout.log"
    stdout.write_bytes(f"token is {SECRET}\n".encode())
    output = EpisodeOutput(exit=ExecResult(None, None, b"", b"", 0.0, False), stdout_path=stdout)
    store = LocalStore(tmp_path / "store")
    redactor = Redactor({"TOK": SECRET})
    export_attempt(
        store,
        "run-1",
        manifest(),
        3,
        "env-9",
        Outcome.INFRA_ERROR,
        f"boom with {SECRET}",
        output,
        {"console.log": f"console {SECRET}".encode()},
        redactor,
    )
    raw = store.get_bytes("run-1", "ep-1", "attempts/3/attempt.json")
    assert raw is not None
    summary = json.loads(raw)
    logs = {entry["name"]: entry for entry in summary.pop("logs")}
    assert summary == {
        "episode_id": "ep-1",
        "attempt": 3,
        "env_id": "env-9",
        "outcome": "infra_error",
        "error": "boom with [REDACTED:TOK]",
        "secrets": {"names": ["TOK"], "redactions": {"TOK": 3}},
    }
    assert set(logs) == {"stdout.log", "console.log"}
    for name, entry in logs.items():
        stored = store.get_bytes("run-1", "ep-1", f"attempts/3/logs/{name}")
        assert stored is not None and b"[REDACTED:TOK]" in stored
        path = f"attempts/3/logs/{name}"
        assert entry == {"name": name, "size": len(stored), "sha256": _sha(stored), "path": path}
    for path in (tmp_path / "store").rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
    assert store.get_record("run-1", "ep-1") is None  # not final: no record


def test_an_artifact_named_after_a_secret_moves_and_its_old_folders_go(tmp_path: Path) -> None:
    """A nested artifact whose folder spells the secret moves to the redacted name in the
    same artifacts folder (its size and sha256 those of the redacted bytes), the emptied
    folders of the old name are removed, and a second artifact redacted to the same name gets
    a unique one."""
    staging = tmp_path / "st"
    first = artifact(staging, f"out/{SECRET}/data.txt", f"x {SECRET} y".encode())
    clash = artifact(staging, "out/[REDACTED:TOK]/data.txt", b"already there")
    output = EpisodeOutput(exit=ExecResult(0, None, b"", b"", 0.0, False))
    output.artifacts = [clash, first]
    redact_output(output, {}, Redactor({"TOK": SECRET}))
    names = [a.name for a in output.artifacts]
    assert names == ["out/[REDACTED:TOK]/data.txt", "out/[REDACTED:TOK]/data.txt~2"]
    moved = output.artifacts[1]
    assert moved.path == staging / "artifacts" / moved.name
    assert moved.path.read_bytes() == b"x [REDACTED:TOK] y"
    assert (moved.size, moved.sha256) == (18, _sha(b"x [REDACTED:TOK] y"))
    assert not (staging / "artifacts" / "out" / SECRET).exists()
    assert (staging / "artifacts" / "out").is_dir()  # the artifacts' common folder stays


def test_unique_names_count_up_then_give_up_on_the_name() -> None:
    """``~2``, ``~3``... after the first free number; a long name is cut to 200 characters
    before the suffix; a name that is not a valid artifact name, or 99 taken, becomes
    ``redacted-N``."""
    assert _unique("a", set()) == "a"
    assert _unique("a", {"a"}) == "a~2"
    assert _unique("a", {"a", "a~2"}) == "a~3"
    assert _unique("a", {"a"} | {f"a~{n}" for n in range(2, 100)}) == "redacted-100"
    long = "x" * 300
    assert _unique(long, {long}) == "x" * 200 + "~2"
    assert _unique("../up", set()) == "redacted-100"


def test_the_result_record_is_redacted_as_json_or_else_as_bytes() -> None:
    """Valid JSON comes back compact with its non-ASCII text as it was; anything else (the
    episode fails on it anyway) is redacted byte-wise."""
    redactor = Redactor({"TOK": SECRET})
    raw = json.dumps({"reward": 1, "info": {"note": f"é {SECRET}"}}).encode()
    expected = '{"reward":1,"info":{"note":"é [REDACTED:TOK]"}}'
    assert _redact_result(raw, redactor) == expected.encode()
    broken = b'{"reward": ' + SECRET.encode()
    assert _redact_result(broken, redactor) == b'{"reward": [REDACTED:TOK]'


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
