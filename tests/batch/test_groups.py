"""Groups with the fake driver: one setup shared by a group's episodes (fast, no VM).

``ForkingFake`` (a pretend fork) drives the orchestration of the forked path: setup once,
snapshot, clones, parent and snapshot gone on every path. The plain fake driver has no fork and
takes the per-episode fallback. What fork does inside a VM is proven in
tests/drivers/qemu/test_fork.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cleanroom.api as cr
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.checks.repro import differences
from cleanroom.drivers.base import Owner, new_snapshot_id
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import ManifestError
from cleanroom.evidence.manifest import Manifest, parse_manifests
from cleanroom.evidence.provenance import missing
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.reaper import reap
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline
from ..forking_fake import ForkingFake
from ..lifecycle.test_reaper import dead_pid
from ..vmkit import assert_nothing_left
from ..waiting import until


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def members(gid: str, setup: list[str], n: int = 3, **task: Any) -> list[Manifest]:
    return cr.group(
        gid,
        {"command": setup, "timeout_s": 30},
        [
            {"episode_id": f"{gid}-{i}", "seed": i, "policy": {"id": "p"}, "task": task}
            for i in range(n)
        ],
    )


class Harness:
    def __init__(self, tmp: Path, driver: FakeDriver, parallel: int = 2) -> None:
        self.tmp = tmp
        self.ledger = Ledger(tmp / "ledger.db")
        self.store = LocalStore(tmp / "store")
        self.driver = driver
        self.baseline = make_fake_baseline(tmp)
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.ctl = Controller(
            driver,
            self.ledger,
            self.store,
            options=RunOptions(parallel=parallel, cleanup_window_s=5, staging_dir=tmp / "staging"),
            on_event=lambda kind, data: self.events.append((kind, data)),
        )
        self.counter = tmp / "setup-ran"
        self.count_setup = py(f"open({str(self.counter)!r}, 'a').write('x')")

    def setup_runs(self) -> int:
        return len(self.counter.read_text()) if self.counter.exists() else 0

    def assert_nothing_left(self, run_id: str) -> None:
        assert_nothing_left(self.driver, self.ledger, run_id, self.store)
        for snap in self.ledger.snapshots(run_id=run_id):
            assert snap.confirmed_absent_at is not None, snap
        assert self.driver.list_snapshots() == []
        assert self.driver.list_owned() == []


@pytest.fixture
def forking(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path, ForkingFake(tmp_path), parallel=3)
    yield h
    h.ledger.close()


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path, FakeDriver(run_root=tmp_path / "run"))
    yield h
    h.ledger.close()


async def test_a_forked_group_runs_its_setup_once_and_records_the_warm_state(
    forking: Harness,
) -> None:
    h = forking
    batch = [
        *members("g1", h.count_setup),
        Manifest.model_validate({"episode_id": "solo", "seed": 9, "policy": {"id": "p"}}),
    ]
    result = await h.ctl.run(batch, h.baseline, run_id="r1")
    assert result.counts() == {"completed": 4}
    assert h.setup_runs() == 1
    assert h.driver.calls.count("parent") == 1 and h.driver.calls.count("clone") == 3
    [report] = result.groups
    assert report.mode == "fork" and report.classification is None and report.snapshot_deleted
    records = [h.store.get_record("r1", f"g1-{i}") for i in range(3)]
    groups = [r["provenance"]["group"] for r in records if r is not None]
    assert len(groups) == 3 and all(missing(r) == [] for r in records if r is not None)
    assert {g["digest"] for g in groups} == {report.digest}
    assert {g["snapshot"] for g in groups} == {report.snapshot}
    assert groups[0]["setup_digest"] == batch[0].group.setup.digest()  # type: ignore[union-attr]
    assert len({r["provenance"]["env_id"] for r in records if r is not None}) == 3
    assert all(r["provenance"]["start"] == "fork" for r in records if r is not None)
    solo = h.store.get_record("r1", "solo")
    assert solo is not None and "group" not in solo and "group" not in solo["provenance"]
    [snap] = h.ledger.snapshots(run_id="r1")
    assert (snap.group_digest, snap.digest, snap.state) == (
        report.digest,
        report.snapshot,
        "absent",
    )
    parent = h.ledger.get_env(snap.parent_env_id or "")
    assert parent is not None and parent.episode_id is None and parent.confirmed_absent_at
    forked = h.ledger.events("r1", "env_forked")
    assert sorted(e.episode_id or "" for e in forked) == ["g1-0", "g1-1", "g1-2"]
    assert {e.data["group_digest"] for e in forked} == {report.digest}
    # deleted once the last clone was restored, not when the group's last episode ended
    last_end = max(e.ended_at or 0 for e in h.ledger.episodes("r1") if e.episode_id != "solo")
    assert snap.deleted_at is not None
    assert max(e.ts for e in forked) <= snap.deleted_at <= last_end
    h.assert_nothing_left("r1")


async def test_check_repro_compares_the_setup_not_the_warm_state_made_anew(
    forking: Harness,
) -> None:
    h = forking
    for run_id in ("a", "b"):
        result = await h.ctl.run(members("g7", h.count_setup, n=1), h.baseline, run_id=run_id)
        assert result.counts() == {"completed": 1}
    records = [h.store.get_record(run_id, "g7-0") for run_id in ("a", "b")]
    assert records[0] is not None and records[1] is not None
    groups = [r["provenance"]["group"] for r in records if r is not None]
    assert groups[0]["digest"] != groups[1]["digest"]  # a new parent, a new snapshot
    assert differences([r for r in records if r is not None]) == {}
    records[1]["provenance"]["group"]["setup_digest"] = "sha256:other"  # type: ignore[index]
    assert list(differences([r for r in records if r is not None])) == [
        "provenance.group.setup_digest"
    ]


async def test_a_failing_setup_gives_every_episode_a_clear_outcome(forking: Harness) -> None:
    h = forking
    boom = py("import sys; print('setup says boom', file=sys.stderr); sys.exit(3)")
    result = await h.ctl.run(members("g2", boom), h.baseline, run_id="r2")
    assert result.counts() == {"infra_error": 3}
    for episode in result.episodes:
        assert episode.error is not None and episode.error.startswith("setup_failed:")
        assert "exit 3" in episode.error and "setup says boom" in episode.error
        assert h.store.get_record("r2", episode.episode_id) is None  # not final: resumable
        logs = Path(h.store.episode_uri("r2", episode.episode_id).removeprefix("file://"))
        assert b"setup says boom" in (logs / "attempts/1/logs/setup-stderr.log").read_bytes()
    assert h.driver.calls == ["parent"]  # no snapshot, no clone
    assert result.groups[0].classification == "setup_failed"
    [failed] = h.ledger.events("r2", "group_failed")
    assert failed.data["classification"] == "setup_failed"
    assert {r.outcome for r in h.ledger.episodes("r2")} == {"infra_error"}
    h.assert_nothing_left("r2")
    ended = [d for k, d in h.events if k == "episode_finished"]
    assert sorted(d["episode_id"] for d in ended) == ["g2-0", "g2-1", "g2-2"]


async def test_clones_that_cannot_be_restored_fail_alone(forking: Harness) -> None:
    h = forking
    h.driver.fail_clones = True
    result = await h.ctl.run(members("g3", h.count_setup, n=2), h.baseline, run_id="r3")
    assert result.counts() == {"infra_error": 2}
    assert all("cannot restore" in (e.error or "") for e in result.episodes)
    assert result.groups[0].classification is None and result.groups[0].snapshot_deleted
    h.assert_nothing_left("r3")


async def test_a_snapshot_that_fails_its_seal_fails_every_clone(forking: Harness) -> None:
    h = forking
    h.driver.fail_seal = True
    result = await h.ctl.run(members("g9", h.count_setup, n=2), h.baseline, run_id="r9")
    assert result.counts() == {"infra_error": 2}
    assert all("snapshot not sealed" in (e.error or "") for e in result.episodes)
    [report] = result.groups
    assert report.classification == "fork_failed" and "changed while sealed" in report.error
    assert report.snapshot is None and report.digest is None and report.snapshot_deleted
    [snap] = h.ledger.snapshots(run_id="r9")
    assert snap.digest is None and snap.state == "absent"
    h.assert_nothing_left("r9")


async def test_a_snapshot_that_cannot_be_deleted_is_an_alert_and_fails_the_run(
    forking: Harness,
) -> None:
    h = forking
    h.driver.fail_deletes = True
    result = await h.ctl.run(members("g8", h.count_setup, n=2), h.baseline, run_id="r8")
    assert result.counts() == {"completed": 2} and not result.ok
    [snap] = h.ledger.snapshots(run_id="r8")
    assert result.leaked_envs == [snap.snapshot_id] and snap.state == "leaked" and snap.live
    assert any(k == "alert" and snap.snapshot_id in d["message"] for k, d in h.events)
    h.driver.fail_deletes = False
    report = await reap(h.driver, h.ledger)  # the next run's reap cannot delete a live owner's
    assert report.snapshots == [] and h.driver.list_snapshots() == [snap.snapshot_id]
    assert await h.driver.delete_snapshot(snap.snapshot_id)


async def test_cancelling_during_the_setup_cleans_up_the_whole_group(forking: Harness) -> None:
    h = forking
    run = asyncio.create_task(
        h.ctl.run(members("g4", py("import time; time.sleep(60)")), h.baseline, run_id="r4")
    )
    await until(
        lambda: any(e.ready_at and e.episode_id is None for e in h.ledger.envs(run_id="r4")),
        "the group's parent env is ready",
    )
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert {r.outcome for r in h.ledger.episodes("r4")} == {"cancelled"}
    h.assert_nothing_left("r4")


async def test_without_fork_each_episode_runs_the_setup_itself(plain: Harness) -> None:
    h = plain
    result = await h.ctl.run(members("g5", h.count_setup), h.baseline, run_id="r5")
    assert result.counts() == {"completed": 3}
    assert h.setup_runs() == 3
    record = h.store.get_record("r5", "g5-1")
    assert record is not None and missing(record) == []
    group = record["provenance"]["group"]
    assert group["mode"] == "per-episode" and group["setup_s"] > 0 and "snapshot" not in group
    assert h.ledger.snapshots(run_id="r5") == []
    boom = py("import sys; sys.exit(4)")
    failed = await h.ctl.run(members("g6", boom, n=2), h.baseline, run_id="r6")
    assert failed.counts() == {"infra_error": 2}
    assert all("setup failed (exit 4)" in (e.error or "") for e in failed.episodes)
    h.assert_nothing_left("r6")


async def test_reap_deletes_the_snapshots_of_a_dead_controller(tmp_path: Path) -> None:
    driver = ForkingFake(tmp_path)
    with Ledger(tmp_path / "ledger.db") as ledger:
        dead, alive = new_snapshot_id(), new_snapshot_id()
        for sid, owner in ((dead, Owner("gone", pid=dead_pid())), (alive, Owner("alive"))):
            fields = owner.ledger_fields()
            ledger.snapshot_intent(
                sid, run_id="r", group_id="g", driver="fake", setup_digest="s", **fields
            )
            (driver.forks / sid).mkdir(parents=True)
            owner_file = {"pid": owner.pid, "host": owner.host, "created_at": 0}
            (driver.forks / sid / "owner.json").write_text(json.dumps(owner_file))
        stray = new_snapshot_id()  # files with no ledger row and no owner (died mid-create)
        (driver.forks / stray).mkdir()
        report = await reap(driver, ledger)
        assert sorted(report.snapshots) == sorted([dead, stray]) and report.failed == []
        assert driver.list_snapshots() == [alive]
        row = ledger.get_snapshot(dead)
        assert row is not None and row.state == "absent" and not row.live
        assert ledger.get_snapshot(alive).live  # type: ignore[union-attr]
        assert [e.data["snapshot_id"] for e in ledger.events("r", "snapshot_reaped")] == [dead]


def test_episodes_of_a_group_must_agree_on_its_setup_and_machine() -> None:
    line = {"seed": 1, "policy": {"id": "p"}, "group": {"id": "g", "setup": {"command": ["a"]}}}
    lines = [
        {**line, "episode_id": "a"},
        {**line, "episode_id": "b", "group": {"id": "g", "setup": {"command": ["b"]}}},
        {**line, "episode_id": "c", "limits": {"memory_mib": 512}},
        {**line, "episode_id": "d", "limits": {"timeout_s": 5}},  # timeouts may differ
    ]
    with pytest.raises(ManifestError) as caught:
        parse_manifests("\n".join(json.dumps(x) for x in lines))
    assert caught.value.problems == [
        "line 2: group 'g': group differ(s) from line 1 (every episode of a group shares one "
        "setup and one machine)",
        "line 3: group 'g': limits.memory_mib differ(s) from line 1 (every episode of a group "
        "shares one setup and one machine)",
    ]
    with pytest.raises(ManifestError, match="group"):
        cr.group("g", {"command": []}, [{"episode_id": "x", "seed": 0, "policy": {"id": "p"}}])
    plain = Manifest.model_validate({"episode_id": "x", "seed": 0, "policy": {"id": "p"}})
    [grouped] = cr.group("g", ["true"], [plain])
    assert grouped.group is not None and grouped.digest() != plain.digest()
    assert "group" not in plain.model_dump(mode="json", exclude_none=True)
