"""Structured logs: every line of an episode carries its run, episode and env ids."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.errors import ConfigError
from cleanroom.observe import logs

from ..batch.test_controller import manifest
from .conftest import Observed


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    logs.close()


def read_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_json_file_binds_ids_to_every_episode_line(
    obs: Observed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_file = tmp_path / "logs" / "run.jsonl"
    logs.setup("json", file=log_file)
    obs.observe(logs.EventLogger().on_event)
    batch = [manifest("a"), manifest("b", mode="fail")]
    await obs.ctl.run(batch, obs.baseline, run_id="l1")
    logs.close()
    lines = read_lines(log_file)
    assert lines[0]["event"] == "run started"
    assert lines[-1]["event"] == "run finished"
    envs = {e.episode_id: e.env_id for e in obs.ledger.envs(run_id="l1")}
    episode_lines = [line for line in lines if "episode_id" in line]
    assert {line["episode_id"] for line in episode_lines} == {"a", "b"}
    for line in episode_lines:
        assert line["run_id"] == "l1", line
        assert line["env_id"] == envs[str(line["episode_id"])], line
        assert line["level"] in ("info", "warning", "error") and "timestamp" in line
    steps = [line["event"] for line in episode_lines if line["episode_id"] == "a"]
    assert steps == ["episode started", "env ready", "episode finished"]
    finished = {line["episode_id"]: line for line in lines if line["event"] == "episode finished"}
    assert finished["a"]["outcome"] == "completed" and finished["a"]["confirmed_absent"] is True
    record = obs.store.get_record("l1", "a")  # the operator's line says the durable reward
    assert record is not None and record["reward"] is not None
    assert finished["a"]["reward"] == record["reward"] and finished["a"]["attempt"] == 1
    assert finished["b"]["outcome"] == "episode_error" and finished["b"]["error"]
    assert isinstance(finished["a"]["timings"], dict) and "provision_s" in finished["a"]["timings"]
    # stderr got the same lines as JSON (not a terminal under pytest)
    err_lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert len(err_lines) == len(lines)


def test_console_format_is_human_readable(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("console")
    hook = logs.EventLogger().on_event
    hook("run_started", {"run_id": "r1", "total": 1, "skipped": 0})
    hook("episode_started", {"episode_id": "e1", "attempt": 1, "env_id": "env-1"})
    hook(
        "episode_finished",
        {
            "episode_id": "e1",
            "env_id": "env-1",
            "outcome": "completed",
            "reward": 2.0,
            "confirmed_absent": True,
            "cleanup_ms": 12.3456,
            "timings": {"run_s": 1.0},
        },
    )
    err = capsys.readouterr().err
    assert not any(line.startswith("{") for line in err.splitlines())
    assert "episode finished" in err and "episode_id=e1" in err and "env_id=env-1" in err
    assert "outcome=completed" in err and "cleanup_ms=12.346" in err
    assert "timings" not in err  # per-phase detail stays in the JSON sinks


def test_auto_format_follows_the_terminal() -> None:
    assert logs.resolve_format("auto", is_tty=True) == "console"
    assert logs.resolve_format("auto", is_tty=False) == "json"
    assert logs.resolve_format("json", is_tty=True) == "json"
    with pytest.raises(ConfigError):
        logs.resolve_format("xml")
    with pytest.raises(ConfigError):
        logs.setup("json", level="chatty")


def test_setup_twice_replaces_its_sinks(tmp_path: Path) -> None:
    logs.setup("json", file=tmp_path / "a.jsonl")
    logs.setup("json", stderr=False, file=tmp_path / "b.jsonl")
    logger = logging.getLogger(logs.LOGGER_NAME)
    ours = [h for h in logger.handlers if not type(h).__name__.startswith("LogCapture")]
    assert len(ours) == 1 and not logger.propagate  # (pytest may add its capture handlers)
    logs.get_logger(run_id="r").info("hello", n=1)
    logs.close()
    assert read_lines(tmp_path / "b.jsonl")[0]["event"] == "hello"
    assert (tmp_path / "a.jsonl").read_text() == ""


def test_alerts_and_drift_are_errors(tmp_path: Path) -> None:
    logs.setup("json", stderr=False, file=tmp_path / "x.jsonl")
    hook = logs.EventLogger().on_event
    hook("run_started", {"run_id": "r", "total": 1, "skipped": 0})
    hook("alert", {"message": "env env-9 still present", "env_id": "env-9", "episode_id": "e"})
    hook("drift_refused", {"digest": "sha256:ab", "drifted": ["vmlinux"]})
    logs.close()
    lines = read_lines(tmp_path / "x.jsonl")
    assert [(x["event"], x["level"]) for x in lines[1:]] == [
        ("alert", "error"),
        ("baseline drift refused", "error"),
    ]
    assert lines[1]["env_id"] == "env-9" and lines[2]["drifted"] == ["vmlinux"]
