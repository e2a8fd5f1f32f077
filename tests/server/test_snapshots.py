"""Named snapshots (E2B's ``create_snapshot``, ``Sandbox.create(<snapshot id>)``,
``list_snapshots``, ``delete_snapshot``) through the real ``e2b`` SDK against ``cleanroom
serve --driver fake-snap`` (the server and key fixtures of ``test_pause``)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException, SandboxNotFoundException, ServiceBusyException

from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.fake_snap import DISK, SnapshotFake
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore, open_store

from .kit import Server, new_key, outcome, steps, stored_fake_baseline
from .test_pause import ROOT, key, server

__all__ = ["key", "server"]  # the fixtures, shared with test_pause's module


def _listed() -> list[str]:
    return [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]


def _gone(snap_id: str) -> None:
    assert not SnapshotFake().folder(snap_id).exists()
    with Ledger() as ledger:
        row = ledger.get_snapshot(snap_id)
        assert row is not None and row.confirmed_absent_at is not None


def test_create_from_a_snapshot_twice(key: str) -> None:
    """Protects: ``create_snapshot`` saves a running sandbox's state while it keeps running
    (it serves commands after, and is still ``running``); its files are private (0700
    folder, no group/other bits); two sandboxes created from the snapshot id each see the
    file written before the snapshot and not the one written after, each their own session
    whose transcript has the resume naming the snapshot; the snapshot outlives its sandbox
    and stays until deleted; delete removes its files (ledger confirms absent), unlists it,
    and a second delete or a create from it is not found."""
    src = Sandbox.create("fake")
    src.commands.run(f"echo before > {ROOT}/before.txt")
    info = src.create_snapshot()
    snap_id = info.snapshot_id
    assert info.names == [snap_id]
    src.commands.run(f"echo after > {ROOT}/after.txt")
    assert src.commands.run(f"cat {ROOT}/after.txt").stdout == "after\n"
    assert Sandbox.get_info(src.sandbox_id).state.value == "running"
    folder = SnapshotFake().folder(snap_id)
    assert folder.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o077 == 0 for f in folder.iterdir())
    assert _listed() == [snap_id]
    assert [s.snapshot_id for s in Sandbox.list_snapshots(src.sandbox_id).next_items()] == [snap_id]
    src.kill()  # the snapshot outlives its sandbox (and the key's quota is 3)
    assert folder.is_dir() and _listed() == [snap_id]

    copies = [Sandbox.create(snap_id), Sandbox.create(snap_id)]
    ids = {c.sandbox_id for c in copies}
    assert len(ids) == 2 and src.sandbox_id not in ids
    for c in copies:
        assert c.commands.run(f"cat {ROOT}/before.txt").stdout == "before\n"
        probe = c.commands.run(f"test -e {ROOT}/after.txt && echo yes || echo no")
        assert probe.stdout == "no\n"
    copies[0].commands.run(f"echo mine > {ROOT}/before.txt")
    assert copies[1].commands.run(f"cat {ROOT}/before.txt").stdout == "before\n"
    assert folder.is_dir()  # restoring keeps a named snapshot

    store = open_store(None)
    assert isinstance(store, LocalStore)
    for c in copies:
        sid = c.sandbox_id
        c.kill()
        assert outcome(sid, FakeDriver()) == "completed"
        first = steps(store, f"serve-{sid}", sid, attempt=1)
        resumes = [s for s in first if s.get("op") == "resume"]
        assert resumes and resumes[0]["snapshot_id"] == snap_id
        assert resumes[0]["paused_episode"] == src.sandbox_id
        with Ledger() as ledger:
            (ev,) = [e for e in ledger.events(f"serve-{sid}") if e.kind == "env_resumed"]
            assert ev.data["snapshot_id"] == snap_id

    assert Sandbox.delete_snapshot(snap_id) is True
    _gone(snap_id)
    assert _listed() == []
    assert Sandbox.delete_snapshot(snap_id) is False
    with pytest.raises(SandboxException):
        Sandbox.create(snap_id)


def test_another_keys_snapshot_is_not_found(key: str, server: Server) -> None:
    """Protects: another key neither lists, restores nor deletes a key's snapshot: its id is
    not found (404) exactly like an unknown one; nor snapshots the key's sandbox (404); the
    owner's snapshot is untouched."""
    src = Sandbox.create("fake")
    snap_id = src.create_snapshot().snapshot_id
    other = server.sdk_env(new_key("other"))["E2B_API_KEY"]
    assert Sandbox.list_snapshots(api_key=other).next_items() == []
    assert Sandbox.delete_snapshot(snap_id, api_key=other) is False
    assert Sandbox.delete_snapshot("snap-0000000000000000", api_key=other) is False
    with pytest.raises(SandboxException) as theirs:
        Sandbox.create(snap_id, api_key=other)
    with pytest.raises(SandboxException) as unknown:
        Sandbox.create("snap-0000000000000000", api_key=other)
    assert str(theirs.value).replace(snap_id, "X") == str(unknown.value).replace(
        "snap-0000000000000000", "X"
    )
    with pytest.raises(SandboxNotFoundException):
        Sandbox.create_snapshot(src.sandbox_id, api_key=other)
    assert _listed() == [snap_id]
    assert SnapshotFake().folder(snap_id).is_dir()
    assert Sandbox.delete_snapshot(snap_id) is True
    src.kill()


def test_a_tampered_snapshot_is_refused(key: str) -> None:
    """Protects: a snapshot whose files no longer match their digest is refused (409 naming
    the drift) and no sandbox is left from the attempt; delete still removes it."""
    src = Sandbox.create("fake")
    src.commands.run(f"echo secret > {ROOT}/s.txt")
    snap_id = src.create_snapshot().snapshot_id
    disk = SnapshotFake().folder(snap_id) / DISK
    disk.chmod(0o600)
    with disk.open("ab") as f:
        f.write(b"tampered")
    with pytest.raises(SandboxException, match="no longer matches its digest"):
        Sandbox.create(snap_id)
    assert [s.sandbox_id for s in Sandbox.list().next_items()] == [src.sandbox_id]
    assert Sandbox.delete_snapshot(snap_id) is True
    _gone(snap_id)
    src.kill()


def test_snapshots_count_against_the_quota(key: str, server: Server) -> None:
    """Protects: a named snapshot counts against its key's limit (3 here): with one sandbox
    and two snapshots, neither a create nor a third snapshot goes through (429); after a
    delete both do again; ``/metrics`` counts the snapshots held; a snapshot while a command
    runs is refused (503) and the sandbox serves on."""
    src = Sandbox.create("fake")
    sleeper = src.commands.run("sleep 600", background=True)
    with pytest.raises(ServiceBusyException, match="while commands run"):
        src.create_snapshot()
    assert src.commands.kill(sleeper.pid) is True
    end = time.monotonic() + 30
    while True:  # the kill's end reaches the server's process table a moment later
        try:
            a = src.create_snapshot().snapshot_id
            break
        except ServiceBusyException:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    b = src.create_snapshot().snapshot_id
    assert "cleanroom_serve_snapshots 2\n" in httpx.get(server.url + "/metrics").text
    with pytest.raises(SandboxException, match="snapshots"):
        Sandbox.create("fake")
    with pytest.raises(SandboxException, match="snapshots"):
        src.create_snapshot()
    assert Sandbox.delete_snapshot(a) is True
    c = Sandbox.create(b)
    with pytest.raises(SandboxException, match="snapshots"):
        Sandbox.create("fake")
    c.kill()
    assert Sandbox.delete_snapshot(b) is True
    src.kill()


def test_sigterm_deletes_the_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Protects: a server's SIGTERM deletes its named snapshots (files gone, ledger confirms
    absent): they hold guest state and nothing after a restart could name them."""
    baseline = stored_fake_baseline(tmp_path)
    args = ["--driver", "fake-snap", "--template", f"fake={baseline.digest}"]
    srv = Server(args, tmp_path / "serve.log")
    try:
        for name, value in srv.sdk_env(new_key()).items():
            monkeypatch.setenv(name, value)
        snap_id = Sandbox.create("fake").create_snapshot().snapshot_id
        assert SnapshotFake().folder(snap_id).is_dir()
    finally:
        assert srv.stop() == 0, srv.log.read_text()
    _gone(snap_id)
