"""``cleanroom run`` with the observing flags, end to end on the fake driver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cleanroom.cli import app

from ..conftest import make_fake_baseline


def test_run_writes_metrics_textfile_and_json_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CI", "true")
    baseline = make_fake_baseline(tmp_path / "home")
    manifests = tmp_path / "m.jsonl"
    lines = [
        {"episode_id": "ok-0", "seed": 2, "policy": {"id": "p"}},
        {"episode_id": "ok-1", "seed": 4, "policy": {"id": "p"}},
        {"episode_id": "bad", "seed": 1, "policy": {"id": "p"}, "task": {"mode": "fail"}},
    ]
    manifests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    prom, log_file = tmp_path / "metrics" / "cleanroom.prom", tmp_path / "run.jsonl"
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(manifests),
            "--baseline",
            baseline.digest,
            "--driver",
            "fake",
            "--run-id",
            "c1",
            "--metrics-port",
            "0",
            "--metrics-textfile",
            str(prom),
            "--log-file",
            str(log_file),
            "--log-format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "metrics: http://127.0.0.1:" in result.output
    text = prom.read_text()
    assert 'cleanroom_episodes_total{outcome="completed"} 2.0' in text
    assert 'cleanroom_episodes_total{outcome="episode_error"} 1.0' in text
    assert "cleanroom_env_destroy_seconds_count 3.0" in text
    assert "cleanroom_envs_alive 0.0" in text
    logged = [json.loads(x) for x in log_file.read_text().splitlines()]
    finished = [x for x in logged if x["event"] == "episode finished"]
    assert sorted(x["episode_id"] for x in finished) == ["bad", "ok-0", "ok-1"]
    assert all(x["run_id"] == "c1" and x["env_id"].startswith("env-") for x in finished)


def test_bad_log_level_is_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))
    manifests = tmp_path / "m.jsonl"
    manifests.write_text('{"episode_id": "a", "seed": 1, "policy": {"id": "p"}}\n')
    result = CliRunner().invoke(
        app, ["run", str(manifests), "--baseline", "sha256:00", "--log-level", "chatty"]
    )
    assert result.exit_code == 2
