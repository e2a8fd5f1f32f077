"""The result record and the attempt summary as ``export`` writes them (``export_episode``,
``export_attempt``): every field docs/manifests.md documents, with the values given, redacted
where a secret could hide (the error message, logs, diagnostics), and read back from the store
as returned. Real ``LocalStore``; no VM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from cleanroom import __version__
from cleanroom.agent.connection import Artifact, EpisodeOutput, ExecResult
from cleanroom.core.clock import EpisodeClock
from cleanroom.core.states import Outcome
from cleanroom.errors import ExportError
from cleanroom.evidence.export import RECORD_VERSION, export_attempt, export_episode
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.secrets import Redactor
from cleanroom.host.digests import digest_of
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline

SECRET = "tok_RecordFieldSecret77"
RUN = "run-r"


def _manifest() -> Manifest:
    return Manifest.model_validate(
        {
            "episode_id": "e",
            "seed": 7,
            "policy": {"id": "pol", "version": "3"},
            "task": {"level": 2},
            "secrets": ["TOK"],
        }
    )


def _output(tmp: Path) -> EpisodeOutput:
    logs = tmp / "logs"
    logs.mkdir()
    (logs / "stdout.log").write_text(f"said {SECRET}\n")
    art = tmp / "artifacts" / "a.txt"
    art.parent.mkdir()
    art.write_bytes(b"alpha")
    sha = hashlib.sha256(b"alpha").hexdigest()
    result = {
        "reward": 0.5,
        "terminated": True,
        "truncated": False,
        "metrics": {"steps": 3},
        "info": {"level": "done"},
    }
    return EpisodeOutput(
        exit=ExecResult(3, 9, b"", b"", 1.25, True),
        artifacts=[Artifact("a.txt", 5, sha, art)],
        result_raw=json.dumps(result).encode(),
        stdout_path=logs / "stdout.log",
    )


def _read(store: LocalStore, rel: str) -> bytes:
    data = store.get_bytes(RUN, "e", rel)
    assert data is not None, rel
    return data


def _export(tmp: Path, store: LocalStore, output: EpisodeOutput, **kw: Any) -> dict[str, Any]:
    """``export_episode`` of ``_manifest()`` with defaults for what a test does not set."""
    return export_episode(
        store,
        RUN,
        _manifest(),
        1,
        kw.pop("baseline", None) or make_fake_baseline(tmp),
        kw.pop("facts", {}),
        kw.pop("env_id", "env-1"),
        kw.pop("outcome", Outcome.COMPLETED),
        kw.pop("error", None),
        output,
        kw.pop("diagnostics", {}),
        EpisodeClock(0.0),
        kw.pop("redactor", None),
        verdict=kw.pop("verdict", None),
    )


def test_the_record_holds_every_field_as_given(tmp_path: Path) -> None:
    """Protects: the record's documented fields (version, outcome, terminated/truncated,
    metrics, seed, policy, task, exit code/signal/timed_out/duration, the redacted error,
    artifacts by name/size/sha256, logs, provenance of the baseline) hold what the episode
    gave, and the stored record is the one returned."""
    store = LocalStore(tmp_path / "store")
    baseline = make_fake_baseline(tmp_path)
    output = _output(tmp_path)
    record = _export(
        tmp_path,
        store,
        output,
        baseline=baseline,
        facts={"driver": "fake"},
        env_id="env-9",
        outcome=Outcome.EPISODE_ERROR,
        error=f"entrypoint failed near {SECRET}",
        diagnostics={"extra.txt": f"diag {SECRET}".encode()},
        redactor=Redactor({"TOK": SECRET}),
        verdict={"passed": False, "score": 0.25},
    )
    assert store.get_record(RUN, "e") == record
    assert record["record_version"] == RECORD_VERSION
    assert (record["episode_id"], record["run_id"], record["attempt"]) == ("e", RUN, 1)
    assert record["verdict"] == {"passed": False, "score": 0.25}
    assert record["info"] == {"level": "done"}
    assert record["timings"]["export_s"] >= 0 and "export" in record["timings"]["phases"]
    assert (record["outcome"], record["reward"], record["seed"]) == ("episode_error", 0.5, 7)
    assert (record["terminated"], record["truncated"]) == (True, False)
    assert record["metrics"] == {"steps": 3} and record["task"] == {"level": 2}
    assert record["policy"] == {"id": "pol", "version": "3", "params": {}}
    assert record["exit"] == {"code": 3, "signal": 9, "timed_out": True, "duration_s": 1.25}
    assert record["error"] == {"message": "entrypoint failed near [REDACTED:TOK]"}
    sha = hashlib.sha256(b"alpha").hexdigest()
    path = "attempts/1/artifacts/a.txt"  # the attempt's own folder, named in the record
    assert record["artifacts"] == [{"name": "a.txt", "size": 5, "sha256": sha, "path": path}]
    assert record["evidence"] == "attempts/1"
    assert [log["name"] for log in record["logs"]] == ["stdout.log", "extra.txt"]
    assert [log["path"] for log in record["logs"]] == [
        "attempts/1/logs/stdout.log",
        "attempts/1/logs/extra.txt",
    ]
    assert _read(store, "attempts/1/logs/extra.txt") == b"diag [REDACTED:TOK]"
    assert SECRET.encode() not in _read(store, "attempts/1/logs/stdout.log")
    prov = record["provenance"]
    assert prov["baseline"] == baseline.digest and prov["baseline_name"] == baseline.name
    assert prov["kernel"] == baseline.kernel_version and prov["env_id"] == "env-9"
    assert prov["driver"] == "fake"
    assert record["secrets"]["names"] == ["TOK"] and record["secrets"]["redactions"]["TOK"] >= 3


def test_a_record_without_error_says_none(tmp_path: Path) -> None:
    """Protects: a completed episode's record has ``error: null``, not an empty message."""
    store = LocalStore(tmp_path / "store")
    record = _export(tmp_path, store, _output(tmp_path))
    assert record["error"] is None


def test_the_attempt_summary_names_its_env_and_redacts(tmp_path: Path) -> None:
    """Protects: attempts/<n>/attempt.json names the episode, attempt, env, outcome and the
    redacted error, lists the logs kept under attempts/<n>/logs/ (the staged stdout among
    them, redacted), and counts the redactions; nothing stored holds the secret."""
    store = LocalStore(tmp_path / "store")
    export_attempt(
        store,
        RUN,
        _manifest(),
        2,
        "env-7",
        Outcome.ENV_CRASHED,
        f"guest lost near {SECRET}",
        _output(tmp_path),
        {"console.log": f"boot {SECRET}".encode()},
        Redactor({"TOK": SECRET}),
    )
    summary: dict[str, Any] = json.loads(_read(store, "attempts/2/attempt.json"))
    logs = summary.pop("logs")
    secrets = summary.pop("secrets")
    assert summary == {
        "episode_id": "e",
        "attempt": 2,
        "env_id": "env-7",
        "outcome": "env_crashed",
        "error": "guest lost near [REDACTED:TOK]",
    }
    assert [log["name"] for log in logs] == ["stdout.log", "console.log"]
    assert _read(store, "attempts/2/logs/stdout.log") == b"said [REDACTED:TOK]\n"
    assert _read(store, "attempts/2/logs/console.log") == b"boot [REDACTED:TOK]"
    assert secrets["names"] == ["TOK"] and secrets["redactions"]["TOK"] >= 3
    stored = [p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert stored and not [b for b in stored if SECRET.encode() in b]


def test_without_a_redactor_the_error_is_kept_as_it_is(tmp_path: Path) -> None:
    """Protects: an episode that ended before its secrets were resolved has no redactor; its
    record and its attempt summary still keep its error (or none), never crash on it."""
    store = LocalStore(tmp_path / "store")
    record = _export(tmp_path, store, _output(tmp_path), error="drift refused")
    assert record["error"] == {"message": "drift refused"}
    for attempt, error in ((1, "drift refused"), (2, None)):
        export_attempt(
            store, RUN, _manifest(), attempt, "env-1", Outcome.INFRA_ERROR, error, None, {}
        )
        summary = json.loads(_read(store, f"attempts/{attempt}/attempt.json"))
        assert summary["error"] == error and summary["outcome"] == "infra_error"


def test_an_artifact_changed_since_it_arrived_is_refused(tmp_path: Path) -> None:
    """Protects: an artifact whose stored bytes are not the ones that arrived (its digest on
    arrival differs) is an ExportError naming it, and no record is written."""
    store = LocalStore(tmp_path / "store")
    output = _output(tmp_path)
    output.artifacts = [Artifact("a.txt", 5, "0" * 64, output.artifacts[0].path)]
    with pytest.raises(ExportError, match=r"artifact a\.txt: stored bytes differ"):
        _export(tmp_path, store, output)
    assert store.get_record(RUN, "e") is None


def test_the_record_names_its_baseline_build_and_run_in_provenance(tmp_path: Path) -> None:
    """Protects: provenance (spec digest, agent, image, lock, manifest digest, fresh env,
    cleanroom version, host), the run's timings and the group are in the record; an image,
    a lock or a native agent's digest is named only when the baseline has one."""
    store = LocalStore(tmp_path / "store")
    baseline = make_fake_baseline(tmp_path)
    plain = _export(tmp_path, store, _output(tmp_path), baseline=baseline)
    prov = plain["provenance"]
    assert prov["spec_digest"] == baseline.spec_digest
    assert prov["agent_version"] == baseline.agent_version
    assert prov["manifest_digest"] == _manifest().digest() and prov["fresh_env"] is True
    assert prov["cleanroom_version"] == __version__ and prov["cleanroom_revision"]
    assert prov["host"]["hostname"] == socket.gethostname()
    assert not {"agent_sha256", "image", "lock"} & set(prov) and "group" not in plain
    timings = plain["timings"]
    assert timings["started_at"] <= timings["ended_at"]
    assert set(timings["phases"]) == {"queue", "export"}
    built = dataclasses.replace(baseline, image={"ref": "img:1"}, lock={"debs": ["x=1"]})
    (tmp_path / "second").mkdir()
    grouped = Manifest.model_validate(
        {**_manifest().model_dump(), "group": {"id": "g1", "setup": {"command": ["prep"]}}}
    )
    record = export_episode(
        LocalStore(tmp_path / "other"), RUN, grouped, 1, built, {}, "env-2",
        Outcome.COMPLETED, None, _output(tmp_path / "second"), {}, EpisodeClock(0.0),
    )  # fmt: skip
    prov = record["provenance"]
    assert prov["image"] == {"ref": "img:1"}
    assert prov["lock"] == digest_of({"debs": ["x=1"]}) and record["group"] == "g1"
