"""The edges of one ``Episode`` that a batch's happy path never reaches (fake driver, real store
and ledger): which env id it asks the driver for, what it keeps of its env and its staging, and
the two places where ``_finish`` must go on although something failed under it.

Each test names the promise it protects; each fails on the code that breaks it (found by
mutation testing: ``bench/results/mutation.txt``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.core.states import EpisodeState, Outcome
from cleanroom.drivers.base import Env, EnvRequest, Owner
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.lifecycle.context import RunContext, RunOptions
from cleanroom.lifecycle.episode import Episode, EpisodeKey

from ..batch.test_controller import Harness, manifest

SPARE_ID = "env-spare0000001"


class SpareFake(FakeDriver):
    """A fake that says it has a spare for every shape: records who asked, for what."""

    def __init__(self, run_root: Path) -> None:
        super().__init__(run_root=run_root)
        self.asked: list[tuple[Baseline, ResolvedLimits]] = []

    def next_env_id(self, baseline: Baseline, limits: ResolvedLimits) -> str:
        self.asked.append((baseline, limits))
        return SPARE_ID


class ConsoleFake(FakeDriver):
    """A fake whose envs have a console to read back (the fake's own processes keep none)."""

    def diagnostics(self, env_id: str) -> dict[str, bytes]:
        return {"console.log": f"[    0.1] {env_id} booted\n".encode()}


def _harness(tmp_path: Path, driver: FakeDriver) -> Harness:
    """A harness whose run ``re`` is started, with episode ``x``'s attempt 1 queued."""
    harness = Harness(tmp_path, driver)
    digest = harness.baseline.digest
    harness.ledger.start_run(
        "re", controller_id="c", baseline=digest, driver="fake", parallel=1, meta={}
    )
    harness.ledger.episode_queued("re", "x", 1)
    return harness


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = _harness(tmp_path, ConsoleFake(run_root=tmp_path / "run"))
    yield harness
    harness.ledger.close()


def _ctx(h: Harness, events: list[tuple[str, dict[str, Any]]] | None = None) -> RunContext:
    def emit(kind: str, **data: Any) -> None:
        if events is not None:
            events.append((kind, data))

    options = RunOptions(cleanup_window_s=5, staging_dir=h.tmp / "staging")
    return RunContext(h.driver, h.ledger, h.store, Owner("c"), options=options, emit=emit)


def test_only_a_plain_episode_asks_the_driver_for_a_spare(tmp_path: Path) -> None:
    """Protects the spare rule: an episode the driver starts itself (no ``start``) of a
    baseline with no network takes the driver's next id (a spare's, reserved), asked for with
    its own baseline and limits; a group clone (``start`` given) or an episode with egress (a
    spare has no NIC) never asks, so no spare is reserved and left running for nobody."""
    driver = SpareFake(tmp_path / "run")
    h = Harness(tmp_path, driver)
    ctx = _ctx(h)
    m = manifest("a", limits={"timeout_s": 7})

    plain = Episode(ctx, EpisodeKey("re", "a", 1), m, h.baseline)
    assert plain.env_id == SPARE_ID
    [(asked_baseline, asked_limits)] = driver.asked
    assert asked_baseline is h.baseline and asked_limits == plain.limits
    assert asked_limits.timeout_s == 7

    async def start(request: EnvRequest) -> Env:
        raise AssertionError("not started here")

    clone = Episode(ctx, EpisodeKey("re", "b", 1), m, h.baseline, start=start)
    networked = dataclasses.replace(h.baseline, network=("example.org",))
    egress = Episode(ctx, EpisodeKey("re", "c", 1), m, networked)
    assert len(driver.asked) == 1, "a clone or an egress episode asked for a spare"
    assert clone.env_id != SPARE_ID and egress.env_id != SPARE_ID
    assert clone.env_id != egress.env_id
    h.ledger.close()


async def test_a_completed_episode_keeps_its_envs_console_and_drops_its_staging(
    h: Harness,
) -> None:
    """Protects the evidence and the host: the env's own diagnostics (its console.log) go into
    the durable record's logs, and the attempt's staging folder (the guest's output, copied
    out before export) is gone once the episode is closed."""
    async with Episode(_ctx(h), EpisodeKey("re", "x", 1), manifest("x"), h.baseline) as episode:
        await episode.provision()
        assert episode.staging.is_relative_to(h.tmp / "staging")
        await episode.run()
        assert episode.staging.exists(), "the run left nothing in staging: the test is moot"
    assert episode.result.outcome is Outcome.COMPLETED, episode.result.error
    record = h.store.get_record("re", "x")
    assert record is not None
    assert "console.log" in {log["name"] for log in record["logs"]}
    console = h.store.get_bytes("re", "x", "attempts/1/logs/console.log")
    assert console == f"[    0.1] {episode.env_id} booted\n".encode()
    assert not episode.staging.exists()
    assert [p for p in (h.tmp / "staging").rglob("*") if not p.is_dir()] == []


async def test_a_failed_episodes_ledger_row_says_why(h: Harness) -> None:
    """Protects ``status`` and ``report``: the ledger row of an attempt that failed holds its
    error (the same text as the result's), not only its outcome."""
    async with Episode(_ctx(h), EpisodeKey("re", "x", 1), manifest("x"), h.baseline) as episode:
        await episode.provision()
        raise RuntimeError("the policy fell over")
    assert episode.result.outcome is Outcome.INFRA_ERROR
    assert episode.result.error and "the policy fell over" in episode.result.error
    [row] = h.ledger.episodes("re")
    assert row.outcome == "infra_error" and row.error == episode.result.error


async def test_a_crash_whose_text_is_not_utf8_still_destroys_the_env(h: Harness) -> None:
    """Protects "the env is destroyed and the outcome written whatever happened": an exception
    in the episode's block whose message holds a lone surrogate (not encodable as UTF-8; SQLite
    refused it and the episode's row kept no outcome) is kept as the attempt's traceback and
    the ledger row's error (escaped), and the env is destroyed and confirmed absent."""
    async with Episode(_ctx(h), EpisodeKey("re", "x", 1), manifest("x"), h.baseline) as episode:
        await episode.provision()
        raise RuntimeError("bad text \ud800 from a tool")
    assert episode.result.outcome is Outcome.INFRA_ERROR
    assert episode.result.destroy is not None and episode.result.destroy.confirmed_absent
    trace = h.store.get_bytes("re", "x", "attempts/1/logs/traceback.txt")
    assert trace is not None and b"bad text \\ud800 from a tool" in trace
    assert h.driver.list_owned() == []
    [row] = h.ledger.episodes("re")  # the ledger holds the outcome: SQLite took the text
    assert row.outcome == "infra_error" and row.error and "bad text \\ud800" in row.error


async def test_a_ledger_that_fails_after_the_record_leaves_the_record_and_destroys(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects the order "durable, then destroyed": the ledger failing as the episode moves
    to DURABLE, and again as it moves to DESTROYING, changes nothing of the record's outcome;
    the run hears an alert naming the episode, and the env is still destroyed and confirmed."""
    real = h.ledger.episode_state
    failed: list[str] = []

    def episode_state(run_id: str, episode_id: str, attempt: int, state: str, **kw: Any) -> None:
        if state in (EpisodeState.DURABLE, EpisodeState.DESTROYING):
            failed.append(str(state))
            raise OSError(f"disk I/O error moving to {state}")
        real(run_id, episode_id, attempt, state, **kw)

    monkeypatch.setattr(h.ledger, "episode_state", episode_state)
    events: list[tuple[str, dict[str, Any]]] = []
    async with Episode(
        _ctx(h, events), EpisodeKey("re", "x", 1), manifest("x"), h.baseline
    ) as episode:
        await episode.provision()
        await episode.run()
    assert len(failed) == 2, failed
    assert episode.result.outcome is Outcome.COMPLETED, episode.result.error
    record = h.store.get_record("re", "x")
    assert record is not None and record["outcome"] == "completed"
    assert episode.result.destroy is not None and episode.result.destroy.confirmed_absent
    assert h.driver.list_owned() == []
    alerts = [data["message"] for kind, data in events if kind == "alert"]
    assert len(alerts) == 1 and "after the record of x" in alerts[0], alerts
    [row] = h.ledger.episodes("re")
    assert row.outcome == "completed"


class RecordingFake(ConsoleFake):
    """A fake that keeps every request it was asked to start an env for."""

    def __init__(self, run_root: Path) -> None:
        super().__init__(run_root=run_root)
        self.requests: list[EnvRequest] = []

    async def create(self, request: EnvRequest) -> Env:
        self.requests.append(request)
        return await super().create(request)


async def test_an_episode_asks_for_its_baseline_with_its_deadline_and_walks_every_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects what the host enforces without the controller and what ``status`` shows: the
    env is asked for with the episode's baseline, its run and episode as labels and a hard
    deadline of boot + timeout + collect grace + cleanup window (the host kills it after that,
    controller or not) and its limits; the ledger sees every state in order, DURABLE before
    DESTROYING, and its row ends with the record's reward; the run hears the episode start
    (its attempt) and how the env started (its phases); a plain episode's record says it was
    queued for no time; the episode ends CLOSED."""
    driver = RecordingFake(tmp_path / "run")
    h = Harness(tmp_path, driver)
    h.ledger.start_run(
        "re", controller_id="c", baseline=h.baseline.digest, driver="fake", parallel=1, meta={}
    )
    h.ledger.episode_queued("re", "x", 1)
    states: list[str] = []
    real = h.ledger.episode_state

    def episode_state(run_id: str, episode_id: str, attempt: int, state: str, **kw: Any) -> None:
        states.append(str(state))
        real(run_id, episode_id, attempt, state, **kw)

    monkeypatch.setattr(h.ledger, "episode_state", episode_state)
    events: list[tuple[str, dict[str, Any]]] = []
    ctx = _ctx(h, events)
    m = manifest("x", limits={"timeout_s": 11})
    async with Episode(ctx, EpisodeKey("re", "x", 1), m, h.baseline) as episode:
        await episode.provision()
        await episode.run()
    assert episode.result.outcome is Outcome.COMPLETED, episode.result.error
    [request] = driver.requests
    o = ctx.options
    assert request.baseline is h.baseline and request.limits == episode.limits
    assert request.labels == {"run_id": "re", "episode_id": "x"}
    assert request.hard_deadline_s == o.boot_timeout_s + 11 + o.collect_grace_s + o.cleanup_window_s
    assert states == ["PROVISIONING", "RUNNING", "COLLECTING", "DURABLE", "DESTROYING"]
    [started] = [data for kind, data in events if kind == "episode_started"]
    assert started == {"episode_id": "x", "attempt": 1, "env_id": episode.env_id}
    [ready] = [data for kind, data in events if kind == "env_ready"]
    assert ready["start"] == "cold" and ready["env_id"] == episode.env_id
    assert ready["provision_s"] == episode.clock.phases["provision_s"]  # the hook's phases
    assert episode.state is EpisodeState.CLOSED
    record = h.store.get_record("re", "x")
    assert record is not None and record["timings"]["queue_s"] == 0.0
    [row] = h.ledger.episodes("re")  # status and report read the row: its reward is the record's
    assert row.reward == record["reward"] == 0.5 and row.outcome == "completed"
    h.ledger.close()


@pytest.mark.parametrize("absorb", [True, False])
async def test_an_episode_absorbs_its_blocks_exception_only_when_asked(
    h: Harness, absorb: bool
) -> None:
    """Protects both callers: a batch episode (``absorb``) turns an exception in its block into
    its outcome and the batch goes on; a session (``absorb=False``) has it raised to its
    caller, after the env is destroyed and the outcome written either way."""
    episode = Episode(_ctx(h), EpisodeKey("re", "x", 1), manifest("x"), h.baseline, absorb=absorb)
    raised: list[BaseException] = []
    try:
        async with episode:
            await episode.provision()
            raise KeyError("the caller's bug")
    except KeyError as exc:
        raised.append(exc)
    assert len(raised) == (0 if absorb else 1)
    assert episode.result.outcome is Outcome.INFRA_ERROR
    assert episode.result.destroy is not None and episode.result.destroy.confirmed_absent
    [row] = h.ledger.episodes("re")
    assert row.outcome == "infra_error"


async def test_an_error_quoting_a_secret_reaches_no_ledger_row_or_event(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects "no secret in what is kept": an episode that fails with an error quoting a
    secret it was given keeps that error redacted in its ledger row and in the run's
    episode_finished event (the ledger is on disk; the event reaches logs and the terminal),
    and the ledger says which env the secret went to (names only)."""
    secret = "hf_QuotedInAnError0042"
    monkeypatch.setenv("HF_TOKEN", secret)
    m = Manifest.model_validate(
        {"episode_id": "x", "seed": 1, "policy": {"id": "p"}, "secrets": ["HF_TOKEN"]}
    )
    events: list[tuple[str, dict[str, Any]]] = []
    async with Episode(_ctx(h, events), EpisodeKey("re", "x", 1), m, h.baseline) as episode:
        await episode.provision()
        raise RuntimeError(f"the tool printed {secret} and died")
    [row] = h.ledger.episodes("re")
    assert row.error and "the tool printed" in row.error and secret not in row.error
    [finished] = [data for kind, data in events if kind == "episode_finished"]
    assert finished["error"] == row.error
    [delivered] = h.ledger.events("re", kind="secrets_delivered")
    assert delivered.env_id == episode.env_id and delivered.data["names"] == ["HF_TOKEN"]
    assert secret not in json.dumps(delivered.data)
