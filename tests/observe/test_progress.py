"""Live progress: counts, envs alive, quiet in CI or when stderr is not a terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from cleanroom.observe.progress import RunProgress


def feed(progress: RunProgress) -> None:
    progress.on_event("run_started", {"run_id": "r", "total": 3, "skipped": 0})
    for eid in ("a", "b"):
        progress.on_event("episode_started", {"episode_id": eid, "attempt": 1, "env_id": eid})
    progress.on_event(
        "episode_finished",
        {"episode_id": "a", "outcome": "completed", "reward": 1.0, "confirmed_absent": True},
    )


def test_counts_and_envs_alive() -> None:
    progress = RunProgress(Console(file=io.StringIO(), force_terminal=False))
    feed(progress)
    assert (progress.done, progress.running, progress.queued, progress.failed) == (1, 1, 1, 0)
    assert progress.alive == 1
    assert progress.describe() == "1/3 done · 1 running · 1 queued · 0 failed · 1 envs alive"
    progress.on_event(
        "episode_finished",
        {"episode_id": "b", "outcome": "infra_error", "confirmed_absent": False},
    )
    assert progress.failed == 1 and progress.alive == 1  # a leaked env stays alive


def test_plain_lines_when_not_a_terminal() -> None:
    buffer = io.StringIO()
    with RunProgress(Console(file=buffer, force_terminal=False, width=200)) as progress:
        assert not progress.live
        feed(progress)
        progress.on_event("run_finished", {"run_id": "r", "status": "completed"})
    text = buffer.getvalue()
    assert "run r: 3 episodes" in text and "completed     a reward=1" in text
    assert "1 envs alive" in text and "\x1b[" not in text


def test_quiet_without_lines() -> None:
    buffer = io.StringIO()
    with RunProgress(Console(file=buffer, force_terminal=False), lines=False) as progress:
        feed(progress)
    assert buffer.getvalue() == ""


def test_ci_is_never_animated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert not RunProgress(Console(file=io.StringIO(), force_terminal=True)).live
    monkeypatch.delenv("CI")
    assert RunProgress(Console(file=io.StringIO(), force_terminal=True)).live
