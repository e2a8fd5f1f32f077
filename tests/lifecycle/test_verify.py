"""Verifiers with the fake driver: the verdict is in the record, apart from the outcome."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from cleanroom.core.states import Outcome
from cleanroom.errors import BaselineNotFound, VerifierError
from cleanroom.evidence.manifest import Manifest
from cleanroom.lifecycle.verify import parse_verdict, verdict_label

from ..batch.test_controller import Harness

VERIFIER = """
import json, os, sys, time
root, inp = os.environ["CLEANROOM_DIR"], os.environ["CLEANROOM_VERIFIER_INPUT"]
mode = sys.argv[1]
episode = json.load(open(inp + "/episode.json"))
result = json.load(open(inp + "/result.json")) if os.path.exists(inp + "/result.json") else None
art = inp + "/artifacts/hello.txt"
hello = open(art).read() if os.path.exists(art) else ""
print("verifier ran", mode, flush=True)
if mode == "crash":
    sys.exit("verifier exploded")
if mode == "sleep":
    time.sleep(30)
if mode == "garbage":
    open(root + "/verdict.json", "w").write("{not json")
    sys.exit(0)
details = {
    "outcome": episode["outcome"],
    "hello": hello.strip(),
    "reward": result and result["reward"],
    "sees_episode_out": os.path.exists(root + "/out/hello.txt"),
}
ok = mode == "pass" and episode["outcome"] == "completed"
json.dump({"pass": ok, "score": 1.0 if ok else 0.25, "details": details},
          open(root + "/verdict.json", "w"))
"""


def with_verifier(h: Harness, eid: str, mode: str, **verifier: Any) -> Manifest:
    script = h.tmp / "verifier.py"
    script.write_text(VERIFIER)
    task = verifier.pop("task", {})
    return Manifest.model_validate(
        {
            "episode_id": eid,
            "seed": 2,
            "policy": {"id": "p"},
            "task": task,
            "verifier": {"command": [sys.executable, str(script), mode], **verifier},
        }
    )


@pytest.fixture
def h(tmp_path: Path) -> Any:
    harness = Harness(tmp_path)
    yield harness
    harness.ledger.close()


async def test_fresh_env_verdict_is_recorded(h: Harness) -> None:
    result = await h.ctl.run([with_verifier(h, "a", "pass")], h.baseline, run_id="r")
    [episode] = result.episodes
    assert episode.outcome is Outcome.COMPLETED, episode.error
    record = h.store.get_record("r", "a")
    assert record is not None
    verdict = record["verdict"]
    assert verdict["pass"] is True and verdict["score"] == 1.0
    assert verdict["details"] == {
        "outcome": "completed",
        "hello": "hello from a",
        "reward": 1.0,
        "sees_episode_out": False,  # its own env: only the exported evidence
    }
    about = verdict["verifier"]
    assert about["in_env"] is False and about["exit_code"] == 0
    assert about["baseline"] == h.baseline.digest
    [row] = h.ledger.episodes("r")
    assert row.verdict == "pass" and row.outcome == "completed"
    envs = {e.env_id: e for e in h.ledger.envs(run_id="r")}
    assert about["env_id"] in envs and about["env_id"] != row.env_id
    h.assert_all_destroyed("r")  # the verifier's env too
    folder = Path(h.store.episode_uri("r", "a").removeprefix("file://"))
    assert (folder / "attempts/1/verifier/stdout.log").read_text() == "verifier ran pass\n"
    assert "verify_s" in record["timings"] and "verify" in record["timings"]["phases"]
    states = [e.data for e in h.ledger.events("r", "verified")]
    assert states and states[0]["verdict"] == "pass"


async def test_fail_and_errors_leave_the_outcome_alone(h: Harness) -> None:
    batch = [
        with_verifier(h, "fails", "fail"),
        with_verifier(h, "crashes", "crash"),
        with_verifier(h, "garbage", "garbage"),
        with_verifier(h, "slow", "sleep", timeout_s=1),
        with_verifier(h, "episode-failed", "pass", task={"mode": "fail"}),
    ]
    result = await h.ctl.run(batch, h.baseline, run_id="r")
    outcomes = {e.episode_id: e.outcome for e in result.episodes}
    assert outcomes == {
        "fails": Outcome.COMPLETED,
        "crashes": Outcome.COMPLETED,
        "garbage": Outcome.COMPLETED,
        "slow": Outcome.COMPLETED,
        "episode-failed": Outcome.EPISODE_ERROR,
    }
    verdicts = {eid: h.store.get_record("r", eid)["verdict"] for eid in outcomes}  # type: ignore[index]
    assert verdicts["fails"]["pass"] is False and verdicts["fails"]["score"] == 0.25
    assert verdicts["episode-failed"]["pass"] is False
    assert verdicts["episode-failed"]["details"]["outcome"] == "episode_error"
    for eid, words in (
        ("crashes", "no verdict.json (exit 1): verifier exploded"),
        ("garbage", "not valid JSON"),
        ("slow", "timed out"),
    ):
        assert verdicts[eid]["classification"] == "verifier_error"
        assert words in verdicts[eid]["error"], verdicts[eid]
    labels = {row.episode_id: row.verdict for row in h.ledger.episodes("r")}
    assert labels == {
        "fails": "fail",
        "crashes": "verifier_error",
        "garbage": "verifier_error",
        "slow": "verifier_error",
        "episode-failed": "fail",
    }
    h.assert_all_destroyed("r")


async def test_in_env_verifier_runs_before_teardown(h: Harness) -> None:
    result = await h.ctl.run([with_verifier(h, "a", "pass", in_env=True)], h.baseline, run_id="r")
    [episode] = result.episodes
    record = h.store.get_record("r", "a")
    assert record is not None
    verdict = record["verdict"]
    assert verdict["pass"] is True
    assert verdict["details"]["sees_episode_out"] is True  # the episode's own env
    [row] = h.ledger.episodes("r")
    assert verdict["verifier"]["env_id"] == row.env_id
    assert len(h.ledger.envs(run_id="r")) == 1
    assert episode.destroy is not None and episode.destroy.confirmed_absent


async def test_missing_verifier_baseline_refuses_the_run(h: Harness) -> None:
    manifest = with_verifier(h, "a", "pass", baseline="sha256:" + "ab" * 32)
    with pytest.raises(BaselineNotFound):
        await h.ctl.run([manifest], h.baseline, run_id="r")
    assert h.ledger.envs(run_id="r") == []


def test_manifest_digest_and_guest_view_without_a_verifier() -> None:
    plain = {"episode_id": "a", "seed": 1, "policy": {"id": "p"}}
    manifest = Manifest.model_validate(plain)
    assert "verifier" not in manifest.guest_view()
    canonical = json.dumps(
        {
            k: v
            for k, v in manifest.model_dump(mode="json").items()
            if k not in ("verifier", "group")  # optional fields added later: digests unchanged
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    import hashlib

    assert manifest.digest() == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    checked = Manifest.model_validate({**plain, "verifier": {"command": ["true"]}})
    assert checked.digest() != manifest.digest()
    assert "verifier" not in checked.guest_view()


def test_parse_verdict() -> None:
    assert parse_verdict(b'{"pass": true}') == {"pass": True, "score": 1.0, "details": {}}
    assert parse_verdict(b'{"pass": false, "score": 3}')["score"] == 3.0
    for bad in (
        b"[]",
        b'{"pass": 1}',
        b'{"pass": true, "score": "x"}',
        b"{",
        b'{"pass": true, "score": NaN}',
    ):
        with pytest.raises(VerifierError):
            parse_verdict(bad)
    assert verdict_label(None) is None
    assert verdict_label({"error": "x"}) == "verifier_error"
    assert verdict_label({"pass": False}) == "fail"
