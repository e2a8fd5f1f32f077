"""Run reports: percentiles, counts over the latest attempt, rewards per policy, cleanup."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

from cleanroom.ledger import Ledger
from cleanroom.observe.report import episodes_table, percentile, run_report_json, summary_table
from cleanroom.store import LocalStore

RUN = "run-r"
LONG_ERROR = "launch failed: " + "x" * 200


def test_percentile_is_linear_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile([7.0], 95) == 7.0
    assert percentile(range(101), 95) == 95.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _episode(
    led: Ledger,
    store: LocalStore | None,
    eid: str,
    attempt: int,
    outcome: str,
    *,
    reward: float | None = None,
    policy: str = "p",
    confirmed: bool = True,
    run_s: float = 1.0,
    error: str | None = None,
    provenance: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
) -> None:
    env_id = f"env-{eid}-{attempt}"
    led.episode_queued(RUN, eid, attempt)
    led.episode_state(RUN, eid, attempt, "PROVISIONING", env_id=env_id)
    led.env_intent(
        env_id,
        run_id=RUN,
        episode_id=eid,
        attempt=attempt,
        driver="fake",
        owner_controller="c",
        owner_pid=1,
        owner_host="h",
    )
    if store is not None and outcome in ("completed", "timeout"):
        store.put_record(
            RUN,
            eid,
            {
                "episode_id": eid,
                "run_id": RUN,
                "attempt": attempt,
                "outcome": outcome,
                "reward": reward,
                "verdict": None,
                "policy": {"id": policy, "version": "1", **({"params": params} if params else {})},
                "provenance": provenance or {"start": "snapshot"},
                "timings": {
                    "queue_s": 0.01,
                    "provision_s": 0.5,
                    "run_s": run_s,
                    "started_at": 1e9,
                    "ended_at": 1e9 + 2,
                },
            },
        )
    led.env_destroy_started(env_id)
    led.env_destroyed(env_id, confirmed_absent=confirmed, cleanup_ms=10.0 * attempt, attempts=1)
    led.episode_finished(RUN, eid, attempt, outcome=outcome, reward=reward, error=error)


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[tuple[Ledger, LocalStore]]:
    store = LocalStore(tmp_path / "store")
    with Ledger(tmp_path / "ledger.db") as led:
        led.start_run(RUN, controller_id="c", baseline="b", driver="fake", parallel=2, meta={})
        _episode(led, store, "e1", 1, "completed", reward=1.0, run_s=1.0)
        _episode(led, store, "e2", 1, "env_crashed", error="guest went silent")
        _episode(led, store, "e2", 2, "completed", reward=0.0, run_s=3.0)
        spare = {"start": "snapshot", "spare_s": 0.8}
        _episode(
            led, store, "e3", 1, "completed", reward=5.0, policy="q", run_s=2.0, provenance=spare
        )
        _episode(led, store, "e4", 1, "infra_error", confirmed=False, error=LONG_ERROR)
        led.finish_run(RUN, "completed")
        yield led, store


def test_report_json_counts_latest_attempts_and_groups_rewards(
    scene: tuple[Ledger, LocalStore],
) -> None:
    led, store = scene
    report = run_report_json(RUN, led, store)
    json.dumps(report)  # JSON-ready
    summary = report["summary"]
    assert summary["episodes"] == 4
    assert summary["outcomes"] == {
        "completed": 3,
        "episode_error": 0,
        "timeout": 0,
        "cancelled": 0,
        "env_crashed": 0,
        "infra_error": 1,
        "export_failed": 0,
        "superseded": 0,
    }
    assert summary["rewards"] == {"p@1": {"n": 2, "mean": 0.5}, "q@1": {"n": 1, "mean": 5.0}}
    assert summary["phases"]["run_s"] == {"n": 3, "p50": 2.0, "p95": pytest.approx(2.9)}
    assert "started_at_s" not in summary["phases"] and "started_at" not in summary["phases"]
    assert summary["phases"]["destroy_s"]["n"] == 4
    assert list(summary["phases"]) == ["queue_s", "provision_s", "run_s", "destroy_s"]
    assert summary["envs"] == {"total": 4, "confirmed_absent": 3}
    assert summary["starts"] == {"snapshot": 2, "spare": 1}  # e4 has no record to say
    rows = {r["episode_id"]: r for r in report["episodes"]}
    assert rows["e3"]["start"] == "spare" and rows["e4"]["start"] is None
    assert rows["e2"]["attempt"] == 2 and rows["e2"]["cleanup_ms"] == 20.0
    assert rows["e4"]["confirmed_absent"] is False and rows["e4"]["durable"] is False
    assert report["run"]["status"] == "completed"


def test_report_without_a_store_uses_the_ledger_alone(scene: tuple[Ledger, LocalStore]) -> None:
    led, _ = scene
    summary = run_report_json(RUN, led)["summary"]
    assert summary["rewards"] == {"(unknown)": {"n": 3, "mean": 2.0}}
    assert set(summary["phases"]) == {"destroy_s"}


def _render(table: Table) -> str:
    console = Console(record=True, width=250, color_system=None)
    console.print(table)
    return console.export_text()


def test_episodes_table_shows_cleanup_and_truncates_errors(
    scene: tuple[Ledger, LocalStore],
) -> None:
    led, store = scene
    text = _render(episodes_table(RUN, led, store))
    lines = {
        line.split()[1]: line
        for line in text.splitlines()
        if line.split()[1:2] in (["e1"], ["e2"], ["e3"], ["e4"])
    }
    assert set(lines) == {"e1", "e2", "e3", "e4"}
    assert "completed" in lines["e2"] and " 2 " in lines["e2"] and "20.0" in lines["e2"]
    assert "yes" in lines["e1"] and "NO" in lines["e4"] and "infra_error" in lines["e4"]
    assert "…" in lines["e4"] and "x" * 100 not in text


def test_summary_table_renders_outcomes_rewards_phases(scene: tuple[Ledger, LocalStore]) -> None:
    led, store = scene
    text = _render(summary_table(RUN, led, store))
    for expected in ("completed", "export_failed", "mean reward p@1", "run_s", "p95", "3/4"):
        assert expected in text
    assert "snapshot 2  spare 1" in text
    assert "1 NOT confirmed" in text


def test_unknown_run_is_an_empty_report(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as led:
        report: dict[str, Any] = run_report_json("nope", led, LocalStore(tmp_path / "s"))
        assert report["run"] is None and report["episodes"] == []
        assert sum(report["summary"]["outcomes"].values()) == 0
        assert "not in the ledger" in _render(summary_table("nope", led))


def test_a_parameter_sweep_is_not_merged_into_one_policy(tmp_path: Path) -> None:
    """Rewards used to be grouped by ``id@version`` only, so two settings of a sweep merged:
    where ``params`` differ within one ``id@version`` each setting gets its own row."""
    from cleanroom.host.digests import digest_of

    store = LocalStore(tmp_path / "store")
    with Ledger(tmp_path / "ledger.db") as led:
        led.start_run(RUN, controller_id="c", baseline="b", driver="fake", parallel=2, meta={})
        _episode(led, store, "a", 1, "completed", reward=1.0, params={"k": 0.5})
        _episode(led, store, "b", 1, "completed", reward=3.0, params={"k": 0.5})
        _episode(led, store, "c", 1, "completed", reward=9.0, params={"k": 0.9})
        _episode(led, store, "d", 1, "completed", reward=4.0, policy="q", params={"k": 1})
        _episode(led, store, "e", 1, "completed", reward=6.0, policy="q", params={"k": 1})
        rewards = run_report_json(RUN, led, store)["summary"]["rewards"]
    low, high = (digest_of({"k": k})[7:15] for k in (0.5, 0.9))
    assert rewards == {
        f"p@1#{low}": {"n": 2, "mean": 2.0},
        f"p@1#{high}": {"n": 1, "mean": 9.0},
        "q@1": {"n": 2, "mean": 5.0},  # one setting: the plain label
    }
