"""Metrics fed by controller events (fake driver): counts match outcomes, served over HTTP."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cleanroom.drivers.base import DestroyReport, Env, EnvRequest
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import DestroyError, DriftError, ExportError
from cleanroom.observe.metrics import BUCKETS, RunMetrics, TextfileWriter, compose

from ..batch.test_controller import manifest
from .conftest import Observed

PHASES = ("queue", "provision", "run", "export")


def sample(m: RunMetrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def hist_count(m: RunMetrics, name: str) -> float:
    return sample(m, name + "_count")


async def test_counters_and_histograms_match_the_outcomes(obs: Observed) -> None:
    m = RunMetrics()
    seen: list[str] = []
    obs.observe(compose(m.on_event, lambda kind, data: seen.append(kind)))
    batch = [
        manifest("ok-1"),
        manifest("ok-2"),
        manifest("ok-3"),
        manifest("fail", mode="fail"),
        manifest("slow", mode="sleep", seconds=60, limits={"timeout_s": 1}),
    ]
    result = await obs.ctl.run(batch, obs.baseline, run_id="m1")
    assert result.counts() == {"completed": 3, "episode_error": 1, "timeout": 1}
    for outcome, n in result.counts().items():
        assert sample(m, "cleanroom_episodes_total", outcome=outcome) == n
    assert sample(m, "cleanroom_episodes_total", outcome="infra_error") == 0
    for name in (
        "cleanroom_episode_queue_seconds",
        "cleanroom_env_provision_seconds",
        "cleanroom_episode_run_seconds",
        "cleanroom_episode_export_seconds",
        "cleanroom_env_destroy_seconds",
    ):
        assert hist_count(m, name) == 5, name
    assert sample(m, "cleanroom_env_starts_total", kind="cold") == 5
    assert sample(m, "cleanroom_envs_alive") == 0
    assert sample(m, "cleanroom_envs_orphaned") == 0
    assert sample(m, "cleanroom_env_delete_retries_total") == 0
    assert sample(m, "cleanroom_export_failures_total") == 0
    # the timeout episode ran ~1 s: it lands in a bucket above 0.5 s, below 120 s
    run_sum = sample(m, "cleanroom_episode_run_seconds_sum")
    assert 1.0 <= run_sum < 120 * 5
    le = {f"{b}" for b in BUCKETS}
    assert "0.001" in le and "120.0" in le
    assert seen.count("env_ready") == 5


async def test_export_failure_and_drift_are_counted(obs: Observed) -> None:
    m = RunMetrics()
    obs.observe(m.on_event)

    def refuse(*args: object, **kwargs: object) -> bool:
        raise ExportError("disk full (simulated)")

    real = obs.store.put_record
    obs.store.put_record = refuse  # type: ignore[method-assign]
    await obs.ctl.run([manifest("x")], obs.baseline, run_id="m2")
    obs.store.put_record = real  # type: ignore[method-assign]
    assert sample(m, "cleanroom_export_failures_total") == 1
    assert sample(m, "cleanroom_episodes_total", outcome="export_failed") == 1

    entry = obs.baseline.path / "entry.py"
    entry.write_text(entry.read_text() + "\n# tampered\n")
    with pytest.raises(DriftError):
        await obs.ctl.run([manifest("y")], obs.baseline, run_id="m3")
    assert sample(m, "cleanroom_baseline_drift_refusals_total") == 1


class FlakyDestroy(FakeDriver):
    """The first destroy of every env (its ``aclose``) fails; the driver's retry succeeds."""

    async def create(self, request: EnvRequest) -> Env:
        env = await super().create(request)

        async def fail_once() -> DestroyReport:
            raise DestroyError("busy (simulated)")

        env.aclose = fail_once  # type: ignore[method-assign]
        return env


class NeverGone(FakeDriver):
    """Destroys nothing and never confirms: every env outlives its cleanup window."""

    async def create(self, request: EnvRequest) -> Env:
        env = await super().create(request)

        async def stay() -> DestroyReport:
            return DestroyReport(request.env_id, False, 1, 0.0, "still here (simulated)")

        env.aclose = stay  # type: ignore[method-assign]
        return env

    async def destroy(self, env_id: str) -> DestroyReport:
        return DestroyReport(env_id, False, 1, 0.0, "still here (simulated)")


async def test_delete_retries_are_counted(tmp_path: Path) -> None:
    obs = Observed(tmp_path, FlakyDestroy(run_root=tmp_path / "run"))
    m = RunMetrics()
    obs.observe(m.on_event)
    try:
        result = await obs.ctl.run([manifest("a"), manifest("b")], obs.baseline, run_id="m4")
        assert result.counts() == {"completed": 2}
        assert sample(m, "cleanroom_env_delete_retries_total") == 2
        assert sample(m, "cleanroom_envs_alive") == 0
        obs.assert_all_destroyed("m4")
    finally:
        obs.ledger.close()


async def test_leaked_env_is_an_orphan_and_stays_alive(tmp_path: Path) -> None:
    driver = NeverGone(run_root=tmp_path / "run")
    obs = Observed(tmp_path, driver)
    m = RunMetrics()
    alerts: list[dict[str, Any]] = []
    obs.observe(
        compose(m.on_event, lambda k, d: alerts.append(d) if k == "alert" else None),
        cleanup_window_s=0.3,
    )
    try:
        result = await obs.ctl.run([manifest("a")], obs.baseline, run_id="m5")
        assert result.leaked_envs == ["a"]
        assert sample(m, "cleanroom_envs_orphaned") == 1
        assert sample(m, "cleanroom_envs_alive") == 1
        assert sample(m, "cleanroom_env_delete_retries_total") >= 1
        assert alerts and alerts[0]["env_id"] == obs.ledger.envs(run_id="m5")[0].env_id
    finally:
        for env in obs.ledger.envs(run_id="m5"):
            await FakeDriver.destroy(driver, env.env_id)
        obs.ledger.close()


async def test_metrics_are_served_on_localhost(obs: Observed) -> None:
    m = RunMetrics()
    obs.observe(m.on_event)
    server = m.serve(0)
    try:
        await obs.ctl.run([manifest("a"), manifest("b", mode="fail")], obs.baseline, run_id="m6")
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
            text = response.read().decode()
    finally:
        server.close()
        server.close()  # idempotent
    assert 'cleanroom_episodes_total{outcome="completed"} 1.0' in text
    assert 'cleanroom_episodes_total{outcome="episode_error"} 1.0' in text
    assert "cleanroom_env_provision_seconds_count 2.0" in text
    assert 'cleanroom_env_starts_total{kind="cold"} 2.0' in text
    assert "episode_id" not in text and "env-" not in text  # no high-cardinality labels


def test_textfile_is_written_at_start_periodically_and_at_close(tmp_path: Path) -> None:
    m = RunMetrics()
    path = tmp_path / "prom" / "cleanroom.prom"
    writer = TextfileWriter(m, path, interval_s=0.05).start()
    assert "cleanroom_envs_alive 0.0" in path.read_text()
    m.on_event("episode_started", {"episode_id": "a", "attempt": 1, "env_id": "env-1"})
    for _ in range(100):
        if "cleanroom_envs_alive 1.0" in path.read_text():
            break
        import time

        time.sleep(0.02)
    assert "cleanroom_envs_alive 1.0" in path.read_text()
    m.on_event(
        "episode_finished",
        {"episode_id": "a", "outcome": "completed", "confirmed_absent": True, "cleanup_ms": 4.0},
    )
    writer.close()
    writer.close()
    text = path.read_text()
    assert "cleanroom_envs_alive 0.0" in text
    assert 'cleanroom_episodes_total{outcome="completed"} 1.0' in text
    assert not list(path.parent.glob("*.tmp*"))  # written atomically


def test_registries_are_independent() -> None:
    a, b = RunMetrics(), RunMetrics()
    a.on_event("drift_refused", {"digest": "sha256:x", "drifted": ["f"]})
    assert sample(a, "cleanroom_baseline_drift_refusals_total") == 1
    assert sample(b, "cleanroom_baseline_drift_refusals_total") == 0
