"""Pause, resume (connect), the paused list, kill of a paused sandbox, a tampered snapshot,
the quota, and fork, through the real ``e2b`` SDK against ``cleanroom serve --driver
fake-snap`` (the fake driver with a faithful fake snapshot of the guest's files)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import SandboxException, ServiceBusyException

from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.fake_snap import DISK, SnapshotFake
from cleanroom.ledger import Ledger

from .kit import Server, new_key, outcome, stored_fake_baseline

# the fake guest's own root (its "disk"): the agent's CLEANROOM_GUEST_ROOT, read from its environ
ROOT = "$(tr '\\0' '\\n' </proc/$PPID/environ | sed -n 's/^CLEANROOM_GUEST_ROOT=//p')"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve-pause")
    baseline = stored_fake_baseline(tmp)
    args = ["--driver", "fake-snap", "--template", f"fake={baseline.digest}", "--per-key", "3"]
    srv = Server(args, tmp / "serve.log")
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture
def key(server: Server, monkeypatch: pytest.MonkeyPatch) -> str:
    k = new_key()
    for name, value in server.sdk_env(k).items():
        monkeypatch.setenv(name, value)
    return k


def _snapshots(run_id: str) -> list[str]:
    with Ledger() as ledger:
        return [r.snapshot_id for r in ledger.snapshots(run_id) if r.group_id.startswith("pause:")]


def test_pause_list_resume_keeps_the_files(key: str) -> None:
    """Protects: pause ends the env (confirmed absent) and keeps a private snapshot (0700
    folder, 0600/0400 files); the list shows the sandbox ``paused``; connect resumes it into a
    new env under the same id whose disk has the file written before the pause, the record of
    the resumed incarnation names the paused one (env, snapshot digest); the snapshot's files
    are deleted once it resumed; a second pause of a paused one is False."""
    sbx = Sandbox.create("fake")
    sid = sbx.sandbox_id
    sbx.commands.run(f"echo before-pause > {ROOT}/kept.txt")
    assert sbx.pause() is True
    assert Sandbox.pause(sid) is False
    paused = list(Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items())
    assert [p.sandbox_id for p in paused] == [sid]
    assert Sandbox.get_info(sid).state == SandboxState.PAUSED
    (snap_id,) = _snapshots(f"serve-{sid}")
    folder = SnapshotFake().folder(snap_id)
    assert folder.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o077 == 0 for f in folder.iterdir())
    with Ledger() as ledger:
        first = ledger.envs(run_id=f"serve-{sid}")
        assert first and all(e.confirmed_absent_at for e in first)

    again = Sandbox.connect(sid)
    assert again.sandbox_id == sid
    assert again.commands.run(f"cat {ROOT}/kept.txt").stdout == "before-pause\n"
    running = list(Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items())
    assert sid in [p.sandbox_id for p in running]
    assert not folder.exists()
    with Ledger() as ledger:
        row = ledger.get_snapshot(snap_id)
        assert row is not None and row.confirmed_absent_at is not None
        kinds = [e.kind for e in ledger.events(f"serve-{sid}")]
        assert "session_paused" in kinds and "env_resumed" in kinds
        eps = {e.episode_id for e in ledger.episodes(f"serve-{sid}")}
        assert eps == {sid, f"{sid}.r1"}
    again.kill()
    assert outcome(sid, FakeDriver()) == "completed"


def test_kill_of_a_paused_sandbox_deletes_its_snapshot(key: str) -> None:
    """Protects: kill of a paused sandbox deletes its snapshot files and the ledger confirms
    them absent; it is then gone (not listed, connect is not-found)."""
    sbx = Sandbox.create("fake")
    sid = sbx.sandbox_id
    sbx.pause()
    (snap_id,) = _snapshots(f"serve-{sid}")
    assert SnapshotFake().folder(snap_id).is_dir()
    assert Sandbox.kill(sid) is True
    assert not SnapshotFake().folder(snap_id).exists()
    with Ledger() as ledger:
        row = ledger.get_snapshot(snap_id)
        assert row is not None and row.confirmed_absent_at is not None
    assert sid not in [s.sandbox_id for s in Sandbox.list().next_items()]
    with pytest.raises(SandboxException):
        Sandbox.connect(sid)


def test_a_tampered_snapshot_is_refused(key: str) -> None:
    """Protects: a snapshot whose files no longer match their digest is refused on resume
    (409 naming the drift), nothing is started from it, the sandbox stays paused, and kill
    still deletes it."""
    sbx = Sandbox.create("fake")
    sid = sbx.sandbox_id
    sbx.commands.run(f"echo secret > {ROOT}/s.txt")
    sbx.pause()
    (snap_id,) = _snapshots(f"serve-{sid}")
    disk = SnapshotFake().folder(snap_id) / DISK
    disk.chmod(0o600)
    with disk.open("ab") as f:
        f.write(b"tampered")
    with pytest.raises(SandboxException, match="no longer matches its digest"):
        Sandbox.connect(sid)
    assert Sandbox.get_info(sid).state == SandboxState.PAUSED
    with Ledger() as ledger:
        assert {e.episode_id for e in ledger.episodes(f"serve-{sid}")} == {sid}
    Sandbox.kill(sid)
    assert not disk.parent.exists()


def test_paused_sandboxes_count_against_the_quota(key: str) -> None:
    """Protects: a paused sandbox counts against its key's limit (3 here): with two paused
    and one running, a fourth create is refused with 429, and after killing a paused one a
    create works again."""
    a, b = Sandbox.create("fake"), Sandbox.create("fake")
    a.pause()
    b.pause()
    c = Sandbox.create("fake")
    with pytest.raises(SandboxException, match="paused ones count"):
        Sandbox.create("fake")
    Sandbox.kill(a.sandbox_id)
    d = Sandbox.create("fake")
    for s in (b.sandbox_id, c.sandbox_id, d.sandbox_id):
        Sandbox.kill(s)


def test_fork_into_branches(key: str) -> None:
    """Protects: ``sandbox.fork(count=2)`` gives two new running sandboxes with the parent's
    disk as it was, each its own session (``<parent>.b1``, ``.b2``) whose provenance names
    the parent and the step; what a branch writes is not the parent's; the parent goes on."""
    sbx = Sandbox.create("fake")
    sbx.commands.run(f"echo parent > {ROOT}/p.txt")
    forks = sbx.fork(count=2)
    assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks)
    ids = {f.sandbox_id for f in forks if isinstance(f, Sandbox)}
    assert sbx.sandbox_id not in ids and len(ids) == 2
    for f in forks:
        assert isinstance(f, Sandbox)
        assert f.commands.run(f"cat {ROOT}/p.txt").stdout == "parent\n"
        f.commands.run(f"echo branch > {ROOT}/p.txt")
    assert sbx.commands.run(f"cat {ROOT}/p.txt").stdout == "parent\n"
    for f in forks:
        assert isinstance(f, Sandbox)
        f.kill()
    sid = sbx.sandbox_id
    sbx.kill()
    with Ledger() as ledger:
        eps = {e.episode_id for e in ledger.episodes(f"serve-{sid}")}
        assert eps == {sid, f"{sid}.b1", f"{sid}.b2"}
        assert "env_forked" in [e.kind for e in ledger.events(f"serve-{sid}")]
    assert outcome(sid, FakeDriver()) == "completed"


def test_a_pause_while_a_command_runs_is_refused(key: str) -> None:
    """Protects: a pause while a command runs in the sandbox is refused (503, the SDK's
    ``ServiceBusyException``: the agent
    prepares a snapshot between requests, never during one) and the sandbox serves on; once
    the command is killed, the pause goes through."""
    sbx = Sandbox.create("fake")
    sleeper = sbx.commands.run("sleep 600", background=True)
    with pytest.raises(ServiceBusyException, match="while commands run"):
        sbx.pause()
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    assert sbx.commands.kill(sleeper.pid) is True
    end = time.monotonic() + 30
    while True:  # the kill's end reaches the server's process table a moment later
        try:
            assert sbx.pause() is True
            break
        except ServiceBusyException:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    Sandbox.kill(sbx.sandbox_id)
