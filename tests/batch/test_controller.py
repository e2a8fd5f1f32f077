"""Controller lifecycle with the fake driver: the real agent and protocol, no VM (fast).

Every path must end with exactly one outcome, a destroyed env confirmed absent in the ledger,
and a durable record only for final outcomes. The same paths run on real VMs in tests/vm.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Env, EnvRequest
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import (
    BaselineChanged,
    DriftError,
    ExportError,
    LaunchError,
    LedgerError,
    RunLocked,
)
from cleanroom.evidence.manifest import Manifest
from cleanroom.host import hostproc
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore
from tests.stored import evidence_bytes

from ..conftest import make_fake_baseline
from ..vmkit import assert_nothing_left
from ..waiting import until


def manifest(eid: str, seed: int = 1, **task: Any) -> Manifest:
    limits = task.pop("limits", {})
    return Manifest.model_validate(
        {"episode_id": eid, "seed": seed, "policy": {"id": "p"}, "task": task, "limits": limits}
    )


class Harness:
    def __init__(self, tmp: Path, driver: FakeDriver | None = None) -> None:
        self.tmp = tmp
        self.ledger = Ledger(tmp / "ledger.db")
        self.store = LocalStore(tmp / "store")
        self.driver = driver or FakeDriver(run_root=tmp / "run")
        self.baseline = make_fake_baseline(tmp)
        self.ctl = Controller(
            self.driver,
            self.ledger,
            self.store,
            options=RunOptions(parallel=2, cleanup_window_s=5, staging_dir=tmp / "staging"),
        )

    def assert_all_destroyed(self, run_id: str) -> None:
        assert_nothing_left(self.driver, self.ledger, run_id, self.store)


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    harness.ledger.close()


async def test_completed_episode_is_durable_then_destroyed(h: Harness) -> None:
    result = await h.ctl.run([manifest("a", seed=4)], h.baseline, run_id="r1")
    [episode] = result.episodes
    assert episode.outcome is Outcome.COMPLETED, episode.error
    record = h.store.get_record("r1", "a")
    assert record is not None and record["reward"] == 2.0
    assert record["provenance"]["baseline"] == h.baseline.digest
    assert [a["name"] for a in record["artifacts"]] == ["hello.txt"]
    # a traceback is kept only for a crash: a clean episode's logs hold none
    assert "traceback.txt" not in [log["name"] for log in record["logs"]]
    assert episode.destroy is not None and episode.destroy.confirmed_absent
    h.assert_all_destroyed("r1")
    [row] = h.ledger.envs(run_id="r1")
    # the env row names its attempt: the reaper marks exactly that attempt lost after a crash
    assert (row.episode_id, row.attempt) == ("a", 1)
    assert row.intent_at is not None and row.created_at is not None
    assert row.intent_at <= row.created_at <= (row.confirmed_absent_at or 0)


async def test_each_failure_path_gets_exactly_one_outcome(h: Harness) -> None:
    batch = [
        manifest("fail", mode="fail"),
        manifest("sleep", mode="sleep", seconds=60, limits={"timeout_s": 1}),
        manifest("quota", mode="big", bytes=3 * 1024 * 1024, limits={"output_quota_mib": 1}),
        manifest("bad-mode", mode="unknown"),
    ]
    result = await h.ctl.run(batch, h.baseline, run_id="r2")
    outcomes = {e.episode_id: e.outcome for e in result.episodes}
    assert outcomes == {
        "fail": Outcome.EPISODE_ERROR,
        "sleep": Outcome.TIMEOUT,
        "quota": Outcome.EPISODE_ERROR,
        "bad-mode": Outcome.EPISODE_ERROR,
    }
    quota = next(e for e in result.episodes if e.episode_id == "quota")
    assert quota.error is not None and "QuotaExceeded" in quota.error
    fail = h.store.get_record("r2", "fail")
    assert fail is not None and fail["exit"]["code"] == 3
    stderr = evidence_bytes(h.store, "r2", "fail", "logs", "stderr.log")
    assert b"failing on purpose" in stderr
    assert len(h.ledger.episodes("r2")) == 4
    h.assert_all_destroyed("r2")


async def test_store_failure_is_export_failed_never_success(h: Harness) -> None:
    def refuse(*args: object, **kwargs: object) -> bool:
        raise ExportError("disk full (simulated)")

    h.store.put_record = refuse  # type: ignore[method-assign]
    result = await h.ctl.run([manifest("x")], h.baseline, run_id="r3")
    assert result.episodes[0].outcome is Outcome.EXPORT_FAILED
    assert h.ledger.outcome_counts("r3") == {"export_failed": 1}
    [event] = h.ledger.events("r3", kind="export_failed")  # the audit says why
    assert (event.episode_id, event.data["error"]) == ("x", "disk full (simulated)")
    h.assert_all_destroyed("r3")


async def test_launch_failure_is_infra_error(h: Harness) -> None:
    class Broken(FakeDriver):
        async def create(self, request: EnvRequest) -> Env:
            raise LaunchError("no capacity (simulated)")

    h.ctl.driver = Broken(run_root=h.tmp / "run")
    result = await h.ctl.run([manifest("x")], h.baseline, run_id="r4")
    assert result.episodes[0].outcome is Outcome.INFRA_ERROR
    assert h.store.get_record("r4", "x") is None


async def test_env_killed_mid_episode_is_env_crashed(h: Harness) -> None:
    def ready() -> list[Any]:
        return [e for e in h.ledger.envs(run_id="r5") if e.ready_at is not None]

    async def killer() -> None:  # kill the env's processes once it is running the episode
        for env in await until(ready, "the env is ready"):
            for pid in hostproc.pids_with_marker(env.env_id):
                os.kill(pid, signal.SIGKILL)

    task = asyncio.create_task(killer())
    try:
        result = await h.ctl.run([manifest("x", mode="sleep", seconds=30)], h.baseline, run_id="r5")
    finally:
        task.cancel()
    assert result.episodes[0].outcome is Outcome.ENV_CRASHED
    assert h.store.get_record("r5", "x") is None  # not final: runs again on resume
    h.assert_all_destroyed("r5")


async def test_cancel_destroys_every_running_env(h: Harness) -> None:
    batch = [manifest(f"s{i}", mode="sleep", seconds=60) for i in range(3)]
    run = asyncio.create_task(h.ctl.run(batch, h.baseline, run_id="r6"))
    await until(
        lambda: len([e for e in h.ledger.envs(run_id="r6") if e.ready_at]) >= 2, "2 envs ready"
    )
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    rows = h.ledger.episodes("r6")
    started = [r for r in rows if r.outcome is not None]
    assert {r.outcome for r in started} == {"cancelled"} and len(started) == 2
    h.assert_all_destroyed("r6")
    assert h.driver.list_owned() == []
    assert h.ledger.get_run("r6").status == "cancelled"  # type: ignore[union-attr]


async def test_resume_skips_durable_and_reruns_the_rest(h: Harness) -> None:
    def refuse_b(run_id: str, episode_id: str, record: dict[str, Any]) -> bool:
        if episode_id == "b":
            raise ExportError("simulated")
        return real(run_id, episode_id, record)

    real = h.store.put_record
    h.store.put_record = refuse_b  # type: ignore[method-assign]
    first = await h.ctl.run([manifest("a"), manifest("b")], h.baseline, run_id="r7")
    assert first.counts() == {"completed": 1, "export_failed": 1}
    h.store.put_record = real  # type: ignore[method-assign]
    second = await h.ctl.run([manifest("a"), manifest("b")], h.baseline, run_id="r7")
    assert second.skipped == ["a"]
    [b] = second.episodes
    assert (b.episode_id, b.attempt, b.outcome) == ("b", 2, Outcome.COMPLETED)
    record = h.store.get_record("r7", "b")
    assert record is not None and record["attempt"] == 2
    third = await h.ctl.run([manifest("a"), manifest("b")], h.baseline, run_id="r7")
    assert third.episodes == [] and sorted(third.skipped) == ["a", "b"]


async def test_drifted_baseline_refuses_the_run_by_name(h: Harness) -> None:
    entry = h.baseline.path / "entry.py"
    entry.write_text(entry.read_text() + "\n# tampered\n")
    with pytest.raises(DriftError, match=r"entry\.py"):
        await h.ctl.run([manifest("x")], h.baseline, run_id="r8")
    assert h.ledger.envs(run_id="r8") == []


async def test_parallel_limit_is_respected(h: Harness) -> None:
    peak = 0
    live = 0

    def on_event(kind: str, data: dict[str, Any]) -> None:
        nonlocal peak, live
        live += {"episode_started": 1, "episode_finished": -1}.get(kind, 0)
        peak = max(peak, live)

    h.ctl._on_event = on_event
    result = await h.ctl.run([manifest(f"e{i}") for i in range(5)], h.baseline, run_id="r9")
    assert result.counts() == {"completed": 5}
    assert peak == 2


async def test_secrets_reach_the_guest_and_no_stored_byte_holds_them(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = "hf_Sup3rSecretTokenValue"
    monkeypatch.setenv("HF_TOKEN", value)
    m = Manifest.model_validate(
        {
            "episode_id": "s",
            "seed": 1,
            "policy": {"id": "p"},
            "secrets": ["HF_TOKEN"],
            "task": {"mode": "leak", "secret": "HF_TOKEN"},
        }
    )
    result = await h.ctl.run([m], h.baseline, run_id="rs")
    assert result.episodes[0].outcome is Outcome.COMPLETED, result.episodes[0].error
    record = h.store.get_record("rs", "s")
    assert record is not None
    assert record["info"]["file_matches"] is True  # the guest really had it, as a file too
    assert record["info"]["leak"] == "[REDACTED:HF_TOKEN]"
    assert record["secrets"]["names"] == ["HF_TOKEN"]
    assert record["secrets"]["redactions"]["HF_TOKEN"] >= 4  # stdout, stderr, artifact, record
    stored = [p for p in (h.tmp / "store").rglob("*") if p.is_file()]
    assert stored and not [p for p in stored if value.encode() in p.read_bytes()]
    assert value.encode() not in (h.tmp / "ledger.db").read_bytes()
    for wal in h.tmp.glob("ledger.db*"):
        assert value.encode() not in wal.read_bytes()
    delivered = h.ledger.events("rs", kind="secrets_delivered")
    assert delivered and delivered[0].data["names"] == ["HF_TOKEN"]
    assert delivered[0].episode_id == "s"  # which episode got them (the audit's whole point)


async def test_a_failed_episode_given_secrets_still_says_why(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: an episode that holds secrets and fails keeps its error in its result and
    its durable record (redacting it must not drop it)."""
    monkeypatch.setenv("HF_TOKEN", "hf_Sup3rSecretTokenValue")
    m = Manifest.model_validate(
        {
            "episode_id": "q",
            "seed": 1,
            "policy": {"id": "p"},
            "secrets": ["HF_TOKEN"],
            "task": {"mode": "big", "bytes": 3 * 1024 * 1024},
            "limits": {"output_quota_mib": 1},
        }
    )
    [episode] = (await h.ctl.run([m], h.baseline, run_id="rse")).episodes
    assert episode.outcome is Outcome.EPISODE_ERROR
    assert episode.error is not None and "QuotaExceeded" in episode.error
    record = h.store.get_record("rse", "q")
    assert record is not None and record["error"] == {"message": episode.error}


async def test_a_missing_secret_refuses_the_run(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cleanroom.errors import ConfigError

    monkeypatch.delenv("ABSENT_TOKEN", raising=False)
    m = Manifest.model_validate(
        {"episode_id": "s", "seed": 1, "policy": {"id": "p"}, "secrets": ["ABSENT_TOKEN"]}
    )
    with pytest.raises(ConfigError, match="ABSENT_TOKEN"):
        await h.ctl.run([m], h.baseline, run_id="rs2")
    assert h.ledger.envs(run_id="rs2") == []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


async def test_fake_destroy_takes_the_entrypoints_whole_process_tree(h: Harness) -> None:
    run = asyncio.create_task(
        h.ctl.run([manifest("bg", mode="sleep", seconds=120)], h.baseline, run_id="rt")
    )
    [env] = await until(lambda: [e for e in h.ledger.envs(run_id="rt") if e.ready_at], "ready")
    assert env.pid is not None

    def entrypoint_running() -> list[int]:  # the entrypoint, in its own session
        tree = hostproc.descendants(env.pid)  # type: ignore[arg-type]
        return tree if any(b"entry.py" in _cmdline(p) for p in tree) else []

    tree = await until(entrypoint_running, "the entrypoint runs below the agent")
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert not [p for p in tree if hostproc.pid_alive(p)]


async def test_drift_during_a_run_stops_the_next_env_creation(h: Harness) -> None:
    entry = h.baseline.path / "entry.py"
    refused: list[dict[str, Any]] = []

    def tamper_after_first(kind: str, data: dict[str, Any]) -> None:
        if kind == "drift_refused":  # what metrics and logs count: which episode, which files
            refused.append(data)
        if kind == "episode_finished" and data["episode_id"] == "first":
            entry.write_text(entry.read_text() + "\n# changed mid-run\n")

    h.ctl.options = RunOptions(parallel=1, cleanup_window_s=5, staging_dir=h.tmp / "staging")
    h.ctl._on_event = tamper_after_first
    result = await h.ctl.run([manifest("first"), manifest("second")], h.baseline, run_id="rd")
    outcomes = {e.episode_id: e for e in result.episodes}
    assert outcomes["first"].outcome is Outcome.COMPLETED
    assert outcomes["second"].outcome is Outcome.INFRA_ERROR
    assert "entry.py" in (outcomes["second"].error or "")
    [first_env] = [e for e in h.ledger.envs(run_id="rd") if e.episode_id == "first"]
    assert [e.episode_id for e in h.ledger.envs(run_id="rd")] == ["first", "second"]
    second_env = next(e for e in h.ledger.envs(run_id="rd") if e.episode_id == "second")
    assert second_env.created_at is None  # refused before any VM process existed
    assert first_env.confirmed_absent_at is not None
    assert [(d["episode_id"], d["drifted"]) for d in refused] == [("second", ["entry.py"])]


class Faulty(FakeDriver):
    """A fake driver whose envs raise ``faults[episode_id]`` from their RUN (after the real
    episode when ``after_run``): a bug, or guest input that slipped past every boundary."""

    def __init__(
        self, run_root: Path, faults: dict[str, Exception], *, after_run: bool = False
    ) -> None:
        super().__init__(run_root=run_root)
        self.faults, self.after_run = faults, after_run

    async def create(self, request: EnvRequest) -> Env:
        env = await super().create(request)
        fault = self.faults.get(request.labels.get("episode_id", ""))
        if fault is not None:
            real = env.run_episode

            async def broken(*args: Any, **kwargs: Any) -> Any:
                if self.after_run:
                    await real(*args, **kwargs)
                raise fault

            env.run_episode = broken  # type: ignore[method-assign]
        return env


UNEXPECTED: dict[str, Exception] = {
    "deep": RecursionError("maximum recursion depth exceeded (simulated)"),
    "surrogate": UnicodeEncodeError("utf-8", "x\ud800y", 1, 2, "surrogates not allowed"),
    "key": KeyError("missing"),
}


async def test_an_unexpected_exception_ends_only_its_episode(h: Harness) -> None:
    """Protects: any exception inside one episode (not just CleanroomError/OSError) ends that
    episode infra_error with its traceback kept, its env destroyed and confirmed absent, its
    ledger rows final, and the rest of the batch finishes (before: the TaskGroup aborted the
    whole run and the hostile env lived on); a resume does not crash either."""
    h.ctl.driver = h.driver = Faulty(h.tmp / "run", UNEXPECTED)
    batch = [manifest(eid) for eid in UNEXPECTED] + [manifest("fine", seed=2)]
    result = await h.ctl.run(batch, h.baseline, run_id="rx")
    got = {e.episode_id: e for e in result.episodes}
    assert got["fine"].outcome is Outcome.COMPLETED, got["fine"].error
    for eid, fault in UNEXPECTED.items():
        assert got[eid].outcome is Outcome.INFRA_ERROR, got[eid]
        assert type(fault).__name__ in (got[eid].error or "")
        destroyed = got[eid].destroy
        assert destroyed is not None and destroyed.confirmed_absent
        folder = Path(h.store.episode_uri("rx", eid).removeprefix("file://"))
        trace = (folder / "attempts/1/logs/traceback.txt").read_text()
        assert "Traceback" in trace and type(fault).__name__ in trace
    assert {r.state for r in h.ledger.episodes("rx")} == {"CLOSED"}
    assert h.ledger.get_run("rx").status == "completed"  # type: ignore[union-attr]
    h.assert_all_destroyed("rx")
    again = await h.ctl.run(batch, h.baseline, run_id="rx")  # still faulty: no crash
    assert again.skipped == ["fine"] and again.counts() == {"infra_error": 3}
    h.assert_all_destroyed("rx")
    h.ctl.driver = h.driver = FakeDriver(run_root=h.tmp / "run")
    healed = await h.ctl.run(batch, h.baseline, run_id="rx")
    assert healed.counts() == {"completed": 3}
    assert {e.attempt for e in healed.episodes} == {3}
    h.assert_all_destroyed("rx")


async def test_an_unexpected_exception_while_exporting_is_infra_error(h: Harness) -> None:
    """Protects: a non-store exception in the export (after the episode ran) still ends the
    episode infra_error with no record, its traceback kept, and its env confirmed absent."""
    real = h.store.put_file

    def boom(run_id: str, episode_id: str, rel: str, src: Path) -> Any:
        if episode_id == "x" and "/artifacts/" in rel:
            raise KeyError("simulated bug in the export")
        return real(run_id, episode_id, rel, src)

    h.store.put_file = boom  # type: ignore[method-assign]
    result = await h.ctl.run([manifest("x"), manifest("y")], h.baseline, run_id="rxe")
    got = {e.episode_id: e.outcome for e in result.episodes}
    assert got == {"x": Outcome.INFRA_ERROR, "y": Outcome.COMPLETED}
    assert h.store.get_record("rxe", "x") is None
    folder = Path(h.store.episode_uri("rxe", "x").removeprefix("file://"))
    assert "KeyError" in (folder / "attempts/1/logs/traceback.txt").read_text()
    h.assert_all_destroyed("rxe")


async def test_a_guest_that_breaks_its_quota_ends_final_and_durable(h: Harness) -> None:
    """Protects: a guest's protocol or quota breach is the guest's outcome: episode_error with a
    durable record (logs kept, the reason in ``error``) that a resume does not run again
    (before: only attempts/1/ was written and every resume ran it again)."""
    quota = manifest("quota", mode="big", bytes=3 * 1024 * 1024, limits={"output_quota_mib": 1})
    first = await h.ctl.run([quota], h.baseline, run_id="rq")
    [episode] = first.episodes
    assert episode.outcome is Outcome.EPISODE_ERROR
    record = h.store.get_record("rq", "quota")
    assert record is not None and record["outcome"] == "episode_error"
    assert "QuotaExceeded" in record["error"]["message"]
    assert {log["name"] for log in record["logs"]} >= {"stdout.log", "stderr.log"}
    assert record["exit"]["code"] is None  # the guest never got to say
    [cut] = record["artifacts"]  # what arrived of big.bin before the quota ran out, kept
    assert cut["name"] == "big.bin" and 0 < cut["size"] <= 1024 * 1024
    assert "as far as they arrived" in record["error"]["message"]
    h.assert_all_destroyed("rq")
    again = await h.ctl.run([quota], h.baseline, run_id="rq")
    assert again.skipped == ["quota"] and again.episodes == []


async def test_a_result_the_record_cannot_hold_is_episode_error(h: Harness) -> None:
    """Protects: a result.json with 1e999 (infinity after parsing) in ``info`` is the guest's
    fault: episode_error, durable and final (before: export_failed, retried on every resume)."""

    class Infinite(FakeDriver):
        async def create(self, request: EnvRequest) -> Env:
            env = await super().create(request)
            real = env.run_episode

            async def run(*args: Any, **kwargs: Any) -> Any:
                output = await real(*args, **kwargs)
                output.result_raw = b'{"reward": 1, "info": {"x": 1e999}}'
                return output

            env.run_episode = run  # type: ignore[method-assign]
            return env

    h.ctl.driver = h.driver = Infinite(run_root=h.tmp / "run")
    result = await h.ctl.run([manifest("inf")], h.baseline, run_id="ri")
    assert result.episodes[0].outcome is Outcome.EPISODE_ERROR, result.episodes[0].error
    record = h.store.get_record("ri", "inf")
    assert record is not None and "strict JSON" in record["error"]["message"]
    assert [a["name"] for a in record["artifacts"]] == ["hello.txt"]  # the fine evidence kept
    h.assert_all_destroyed("ri")


async def test_a_second_controller_is_refused_a_live_run(h: Harness) -> None:
    """Protects: two controllers resuming one run id at once would both run every episode;
    the second is refused, naming the holder, and the first's run is unharmed."""
    first = asyncio.create_task(
        h.ctl.run([manifest("slow", mode="sleep", seconds=2)], h.baseline, run_id="rl")
    )
    while not [e for e in h.ledger.envs(run_id="rl") if e.ready_at]:
        await asyncio.sleep(0.05)
    second = Controller(h.driver, h.ledger, h.store, options=h.ctl.options)
    with pytest.raises(RunLocked, match=h.ctl.controller_id):
        await second.run([manifest("slow", mode="sleep", seconds=2)], h.baseline, run_id="rl")
    done = await first
    assert done.counts() == {"completed": 1}
    assert [r.attempt for r in h.ledger.episodes("rl", all_attempts=True)] == [1]
    h.assert_all_destroyed("rl")
    with pytest.raises(BaselineChanged):  # its lock is free now; its baseline is still its own
        await second.run([manifest("slow")], make_fake_baseline(h.tmp / "other"), run_id="rl")


async def test_a_guest_name_too_long_for_the_host_is_the_guests_outcome(h: Harness) -> None:
    """Protects: an artifact name with a 300-character component makes the host's open fail
    with ENAMETOOLONG; that is the guest's doing: episode_error, durable, final (before:
    infra_error, run again on every resume)."""
    too_long = OSError(errno.ENAMETOOLONG, "File name too long", "x" * 300)
    h.ctl.driver = h.driver = Faulty(h.tmp / "run", {"long": too_long}, after_run=True)
    result = await h.ctl.run([manifest("long")], h.baseline, run_id="rn")
    assert result.episodes[0].outcome is Outcome.EPISODE_ERROR, result.episodes[0].error
    record = h.store.get_record("rn", "long")
    assert record is not None and "too long" in record["error"]["message"]
    h.assert_all_destroyed("rn")


async def test_a_run_that_fails_to_queue_releases_its_lock(h: Harness) -> None:
    """Protects: a run whose queueing fails (the ledger refuses a write) still releases its
    lock, so the next controller can take the run (before: it stayed 'running' forever)."""
    real = h.ledger.episode_queued

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise LedgerError("disk I/O error (simulated)")

    h.ledger.episode_queued = refuse  # type: ignore[method-assign]
    with pytest.raises(LedgerError):
        await h.ctl.run([manifest("q")], h.baseline, run_id="rlq")
    assert h.ledger.get_run("rlq").status == "failed"  # type: ignore[union-attr]
    h.ledger.episode_queued = real  # type: ignore[method-assign]
    other = Controller(h.driver, h.ledger, h.store, options=h.ctl.options)
    assert (await other.run([manifest("q")], h.baseline, run_id="rlq")).counts() == {"completed": 1}


async def test_the_controller_returns_episodes_in_input_order(h: Harness) -> None:
    """A slow first episode finishes last, yet comes back first (a training loop indexes by it)."""
    batch = [manifest("slow", mode="sleep", seconds=1.5), manifest("quick-1"), manifest("quick-2")]
    result = await h.ctl.run(batch, h.baseline, run_id="order")
    assert [e.episode_id for e in result.episodes] == ["slow", "quick-1", "quick-2"]
    assert result.record("quick-2")["episode_id"] == "quick-2"


@pytest.mark.parametrize(
    ("parallel", "cores", "spares", "kept"),
    [
        (2, 2, None, 0),
        (2, 3, None, 1),
        (2, 16, None, 2),
        (8, 16, None, 8),
        (16, 16, None, 0),
        (4, 2, None, 0),
        (2, 2, 3, 3),
        (8, 64, 0, 0),
    ],
)
def test_spares_default_to_the_cores_the_episodes_leave_idle(
    parallel: int, cores: int, spares: int | None, kept: int
) -> None:
    """A spare's start and warm-up cost CPU ahead of its episode: free only on a core no
    episode uses, so the default is ``parallel`` at most the idle cores; a given count wins."""
    assert RunOptions(parallel=parallel, spares=spares).spare_count(cores) == kept


async def test_a_run_keeps_the_spares_its_options_count(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept: list[int] = []
    monkeypatch.setattr(h.driver, "keep_spares", kept.append)
    await h.ctl.run([manifest("a")], h.baseline, run_id="sp1")
    assert kept == [h.ctl.options.spare_count()]
    h.ctl.options = RunOptions(parallel=2, spares=5, cleanup_window_s=5, staging_dir=h.tmp / "s")
    await h.ctl.run([manifest("b")], h.baseline, run_id="sp2")
    assert kept[-1] == 5
