"""Shared pieces of the Gymnasium tests: play an episode, read a Gym run's records and
transcripts back, and check that each reset's episode is a durable, destroyed episode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from cleanroom.drivers.base import RunFolderDriver
from cleanroom.gym import CleanroomEnv
from cleanroom.host import paths
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore
from tests.stored import evidence

from ..vmkit import assert_nothing_left


def play(env: Any, seed: int | None, actions: list[int]) -> tuple[list[Any], float]:
    """Reset with ``seed``, take ``actions`` (stopping at the episode's end); the observations
    and the return."""
    obs, _ = env.reset(seed=seed)
    seen, total = [obs], 0.0
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        seen.append(obs)
        total += reward
        if terminated or truncated:
            break
    return seen, total


def transcript(store: LocalStore, run_id: str, episode_id: str) -> list[dict[str, Any]]:
    folder = Path(store.episode_uri(run_id, episode_id).removeprefix("file://"))
    lines = evidence(folder, "logs", "transcript.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def forget_spaces() -> None:
    """Drop every cached space (the next env's first look at its spaces boots a probe)."""
    shutil.rmtree(paths.home() / "gym" / "spaces", ignore_errors=True)


def assert_run_is_evidence(
    env: CleanroomEnv, driver: RunFolderDriver, store: LocalStore, expected: int, ahead: int = 1
) -> list[dict[str, Any]]:
    """After ``close``: ``expected`` episodes (a probe included), each with its record, and
    ``ahead`` episodes opened ahead for a reset that never came (the last ones: ``cancelled``,
    no final record); every env confirmed absent in the ledger and gone from the host; the
    records in order."""
    with Ledger() as ledger:
        rows = sorted(ledger.episodes(env.run_id), key=lambda row: row.episode_id)
        assert len(rows) == expected + ahead, rows
        assert_nothing_left(driver, ledger, env.run_id, store)
    unused = rows[len(rows) - ahead :]
    assert all(row.outcome == "cancelled" and "never came" in (row.error or "") for row in unused)
    assert all(store.get_record(env.run_id, row.episode_id) is None for row in unused)
    records = [store.get_record(env.run_id, row.episode_id) for row in rows[: len(rows) - ahead]]
    assert all(r is not None for r in records)
    return records  # type: ignore[return-value]
