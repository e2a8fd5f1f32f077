"""Fork of a live session (``sessions.fork``): branches that share the parent's state as it was
at the fork and nothing else, each an episode with its own record, the snapshot gone after.

The real proof is on QEMU microVMs (TCG here): a file written and a shell variable saved to a
file before the fork are in every branch, while ``/proc/sys/kernel/random/uuid``, the boot id
and the clone id differ; the parent runs on; every VM is confirmed absent at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Env, EnvRequest, ForkSnapshot
from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.drivers.qemu import fork as qemu_fork
from cleanroom.errors import ConfigError, LaunchError, Unsupported
from cleanroom.evidence.provenance import missing
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import AsyncSession, session
from cleanroom.sessions.fork import Branch, fork_session
from cleanroom.store import LocalStore
from tests.stored import evidence

from ..conftest import make_fake_baseline
from ..forking_fake import ForkingFake
from ..vmkit import assert_nothing_left

OPTIONS = RunOptions(cleanup_window_s=10)
PROBE = (
    "cat /root/work/state.txt /root/work/var.txt; cat /proc/sys/kernel/random/uuid; "
    "cat /proc/sys/kernel/random/boot_id"
)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[Ledger, LocalStore]]:
    with Ledger(tmp_path / "ledger.db") as ledger:
        yield ledger, LocalStore(tmp_path / "store")


def _transcript(store: LocalStore, run_id: str, episode_id: str) -> list[dict[str, object]]:
    folder = Path(store.episode_uri(run_id, episode_id).removeprefix("file://"))
    lines = evidence(folder, "logs", "transcript.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


class _LiveForkingFake(ForkingFake):
    """Says it can fork a live env (its ``fork_live`` is the base's: Unsupported)."""

    capabilities = ForkingFake.capabilities.with_(fork_live=True)


class _PretendLiveFork(_LiveForkingFake):
    """The fake with a pretend live fork: a snapshot folder naming the parent, which runs on
    (what the fork itself does to a VM is proven on qemu below)."""

    gate: asyncio.Event | None = None  # set: clones wait for it
    waiting = 0

    async def fork_clone(self, request: EnvRequest, snap: ForkSnapshot) -> Env:
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
        return await super().fork_clone(request, snap)

    async def fork_live(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        folder = self.forks / snapshot_id
        folder.mkdir(parents=True)
        (folder / "state").write_text(env.env_id)
        return ForkSnapshot(snapshot_id, self.name, None, folder, {"parent_env": env.env_id})


async def test_a_driver_that_cannot_fork_says_so_before_anything_is_made(
    tmp_path: Path, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects: ``forkable=True`` on a driver without ``fork-live`` (fake; a group-only fork)
    and a fork of a session not made forkable are ``Unsupported``; a bad ``n`` is a
    ConfigError; none of them leaves a snapshot row or an env, and the session goes on."""
    ledger, store = parts
    fake = FakeDriver(run_root=tmp_path / "run")
    baseline = make_fake_baseline(tmp_path)
    groups_only = ForkingFake(tmp_path / "groups")
    for driver in (fake, groups_only):
        with pytest.raises(Unsupported, match="driver cannot fork a live session"):
            async with session(baseline, driver=driver, ledger=ledger, store=store, forkable=True):
                pass
    async with session(baseline, driver=fake, ledger=ledger, store=store, run_id="f1") as sb:
        with pytest.raises(Unsupported, match="fake driver cannot fork a live session"):
            await fork_session(sb, 2)
        for bad in (0, -1, 65, 2.0, True):
            with pytest.raises(ConfigError, match=r"1\.\.64"):
                await fork_session(sb, bad)  # type: ignore[arg-type]
        assert (await sb.exec(["true"])).ok
        sb.finish(reward=0.0)
    live = _LiveForkingFake(tmp_path / "live")
    async with session(baseline, driver=live, ledger=ledger, store=store, run_id="f2") as sb:
        with pytest.raises(Unsupported, match="not created with forkable=True"):
            await fork_session(sb, 2)
        sb.finish(reward=0.0)
    for run_id, driver in (("f1", fake), ("f2", live)):
        assert ledger.snapshots(run_id=run_id) == []
        assert ledger.get_run(run_id).status == "completed"  # type: ignore[union-attr]
        assert_nothing_left(driver, ledger, run_id, store)
    assert sorted(r.run_id for r in ledger.list_runs()) == ["f1", "f2"]  # refused: no run


def _forkable(
    tmp_path: Path, driver: ForkingFake, parts: tuple[Ledger, LocalStore], run_id: str
) -> AbstractAsyncContextManager[AsyncSession]:
    """A forkable session ``p`` of the fake baseline on ``driver``."""
    ledger, store = parts
    baseline = make_fake_baseline(tmp_path)
    return session(
        baseline,
        driver=driver,
        ledger=ledger,
        store=store,
        run_id=run_id,
        episode_id="p",
        options=OPTIONS,
        forkable=True,
    )


async def test_branches_outlive_their_parent_and_a_failed_fork_leaves_nothing_open(
    tmp_path: Path, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects (fast, fake fork): branch ids count on across forks (.b1-.b2, then .b3);
    closing the parent closes no branch and the run is finished only when the last branch
    has ended; a fork whose clones fail raises, leaves no branch open, and still deletes its
    snapshot (confirmed absent) while the parent session goes on."""
    ledger, store = parts
    driver = _PretendLiveFork(tmp_path / "pretend")
    async with _forkable(tmp_path, driver, parts, "f3") as sb:
        first = await sb.fork(2)
        [third] = await sb.fork(1)
        assert [b.episode_id for b in [*first, third]] == ["p.b1", "p.b2", "p.b3"]
        driver.fail_clones = True
        with pytest.raises(LaunchError):
            await sb.fork(2)
        driver.fail_clones = False
        assert (await sb.exec(["true"])).ok  # the parent goes on
        sb.finish(reward=0.0)
    run = ledger.get_run("f3")
    assert run is not None and run.finished is None  # three branches still open
    for branch in [*first, third]:
        assert (await branch.exec(["true"])).ok
        async with branch:
            branch.finish(reward=1.0)
    assert ledger.get_run("f3").status == "completed"  # type: ignore[union-attr]
    rows = {r.episode_id: r for r in ledger.episodes("f3")}
    assert rows["p.b4"].outcome == "infra_error" and rows["p.b5"].outcome == "infra_error"
    for eid in ("p", "p.b1", "p.b2", "p.b3"):
        assert rows[eid].outcome == "completed"
        record = store.get_record("f3", eid)
        assert record is not None
        if eid != "p":
            assert record["provenance"]["branch"]["parent_episode"] == "p"
    assert all(s.state == "absent" for s in ledger.snapshots(run_id="f3"))
    assert len(ledger.snapshots(run_id="f3")) == 4  # the RAM file and three forks
    assert driver.list_snapshots() == []
    assert_nothing_left(driver, ledger, "f3", store)


async def test_a_fork_cancelled_while_its_branches_restore_leaves_nothing_open(
    tmp_path: Path, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects: cancelling ``fork`` while its branches restore waits them out, ends every
    one (no env left, each with one outcome), deletes the snapshot, and raises
    CancelledError; the parent session goes on."""
    ledger, store = parts
    driver = _PretendLiveFork(tmp_path / "pretend")
    driver.gate = asyncio.Event()
    async with _forkable(tmp_path, driver, parts, "f4") as sb:
        forking = asyncio.ensure_future(sb.fork(3))
        while driver.waiting < 3:
            await asyncio.sleep(0.01)
        forking.cancel()
        await asyncio.sleep(0.05)
        driver.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await forking
        assert (await sb.exec(["true"])).ok
        sb.finish(reward=0.0)
    rows = {r.episode_id: r for r in ledger.episodes("f4")}
    assert sorted(rows) == ["p", "p.b1", "p.b2", "p.b3"]
    assert all(r.outcome is not None for r in rows.values()), rows
    assert all(s.state == "absent" for s in ledger.snapshots(run_id="f4"))
    assert ledger.get_run("f4").finished is not None  # type: ignore[union-attr]
    assert_nothing_left(driver, ledger, "f4", store)


@pytest.mark.vm
async def test_a_live_session_forks_into_four_that_share_its_state_and_nothing_else(
    tiny_baseline: Baseline, parts: tuple[Ledger, LocalStore]
) -> None:
    """Protects (real VMs): each of 4 branches sees the parent's files as at the fork (one
    written directly, one a shell variable saved, one put through the parent's bulk disk and
    read back through the branch's own), but its own entropy, boot id and clone id; each is an
    episode of the run with its own id, record and ``provenance.branch`` (parent episode, step,
    snapshot digest); the parent runs on (its bulk disk too); the snapshot is deleted and
    confirmed absent once the branches are restored; every VM is confirmed absent."""
    ledger, store = parts
    driver = QemuDriver(start="snapshot")
    async with session(
        tiny_baseline,
        driver=driver,
        ledger=ledger,
        store=store,
        run_id="fork4",
        episode_id="root",
        options=OPTIONS,
        forkable=True,
    ) as sb:
        setup = "mkdir -p /root/work && echo parent-state > /root/work/state.txt"
        (await sb.commands.run(["sh", "-c", setup])).check()
        (await sb.commands.run("X=seven; echo $X > /root/work/var.txt")).check()
        blob = os.urandom(100_000)
        await sb.files.write("/root/work/blob.bin", blob)
        step = sb.steps
        branches = await sb.fork(4)
        assert all(isinstance(b, Branch) for b in branches)
        assert [b.episode.key.episode_id for b in branches] == [f"root.b{i}" for i in (1, 2, 3, 4)]
        [snap] = [s for s in ledger.snapshots(run_id="fork4") if s.group_id == f"root@{step}"]
        assert snap.state == "absent" and snap.digest is not None  # gone once restored
        assert not qemu_fork.folder(snap.snapshot_id).exists()
        seen, clone_ids = [], []
        for branch in branches:
            async with branch:
                env = branch.live_env()
                clone_ids.append((env.hello.get("clone_id"), env.env_id))
                seen.append((await branch.commands.run(PROBE)).check().stdout.split())
                assert "bulk" in env.hello["features"]
                assert await branch.files.read("/root/work/blob.bin") == blob
                branch.finish(reward=1.0, info={"branch": branch.episode.key.episode_id})
        after = (await sb.commands.run(PROBE)).check().stdout.split()
        await sb.files.write("/root/work/after.bin", blob[:5000])  # its disk after the save
        assert await sb.files.read("/root/work/after.bin") == blob[:5000]
        sb.finish(reward=0.5)
    assert all(s[:2] == ["parent-state", "seven"] for s in seen), seen
    assert all(said == env_id for said, env_id in clone_ids)  # each its own clone id
    assert len({env_id for _, env_id in clone_ids}) == 4
    assert after[:2] == ["parent-state", "seven"]  # the parent ran on, its state intact
    assert len({s[2] for s in seen} | {after[2]}) == 5  # uuid: each its own entropy
    assert len({s[3] for s in seen} | {after[3]}) == 5  # boot id: read first after the fork
    envs = set()
    for i in (1, 2, 3, 4):
        record = store.get_record("fork4", f"root.b{i}")
        assert record is not None and record["outcome"] == "completed", record
        assert missing(record) == []
        prov = record["provenance"]
        branch = prov["branch"]
        assert branch["parent_episode"] == "root" and branch["step"] == step
        assert branch["snapshot"] == snap.digest and branch["snapshot_id"] == snap.snapshot_id
        assert prov["start"] == "fork" and prov["env_id"] not in envs
        envs.add(prov["env_id"])
        steps = _transcript(store, "fork4", f"root.b{i}")
        assert [s["op"] for s in steps] == ["exec", "get", "finish"]
    root = store.get_record("fork4", "root")
    assert root is not None and root["outcome"] == "completed"
    forks = [s for s in _transcript(store, "fork4", "root") if s["op"] == "fork"]
    assert forks and forks[0]["branches"] == [f"root.b{i}" for i in (1, 2, 3, 4)]
    assert forks[0]["snapshot"] == snap.digest
    assert ledger.get_run("fork4").status == "completed"  # type: ignore[union-attr]
    assert all(s.state == "absent" for s in ledger.snapshots(run_id="fork4"))
    assert driver.list_snapshots() == []
    assert_nothing_left(driver, ledger, "fork4", store)  # parent and 4 branches: 5 envs
    assert len(ledger.envs(run_id="fork4")) == 5
