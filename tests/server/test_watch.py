"""Watching a sandbox folder with the real ``e2b`` SDK: the sync watcher (``CreateWatcher`` /
``GetWatcherEvents`` / ``RemoveWatcher``) and the async ``watch_dir`` stream, against
``cleanroom serve`` (fake driver: the guest's files are the host's, under ``tmp_path``)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, FilesystemEvent, FilesystemEventType, Sandbox
from e2b.exceptions import NotFoundException, SandboxException

from cleanroom.drivers.fake import FakeDriver
from cleanroom.server.envd.watch import MAX_WATCHERS

from ..waiting import until
from .kit import Server, outcome


def _seen(events: list[FilesystemEvent]) -> set[tuple[str, str]]:
    return {(e.name, e.type.name) for e in events}


def test_a_sync_watcher_reports_what_changed_since_the_last_call(
    key: str, tmp_path: Path, server: Server
) -> None:
    """Protects: create, write, chmod, remove and a rename (its remove and create) reported by
    name relative to the folder; recursive reaches subfolders, not recursive does not; a
    watcher is its sandbox's alone; stopped, it is gone; a file is no folder to watch."""
    (tmp_path / "old.txt").write_text("1")
    (tmp_path / "sub").mkdir()
    sbx = Sandbox.create("fake")
    other = Sandbox.create("fake")
    try:
        flat = sbx.files.watch_dir(str(tmp_path))
        deep = sbx.files.watch_dir(str(tmp_path), recursive=True)
        assert flat.get_new_events() == []

        (tmp_path / "new.txt").write_text("hello")
        (tmp_path / "sub" / "inner.txt").write_text("x")
        os.chmod(tmp_path / "old.txt", 0o600)
        assert _seen(flat.get_new_events()) == {("new.txt", "CREATE"), ("old.txt", "CHMOD")}
        assert ("sub/inner.txt", "CREATE") in _seen(deep.get_new_events())

        with (tmp_path / "new.txt").open("a") as f:
            f.write(" world")  # bigger: a write whatever the mtime's resolution
        (tmp_path / "old.txt").rename(tmp_path / "renamed.txt")
        assert _seen(flat.get_new_events()) == {
            ("new.txt", "WRITE"),
            ("old.txt", "REMOVE"),
            ("renamed.txt", "CREATE"),
        }
        (tmp_path / "sub" / "inner.txt").unlink()
        assert flat.get_new_events() == []  # a subfolder's change: not watched
        assert ("sub/inner.txt", "REMOVE") in _seen(deep.get_new_events())

        # another sandbox's client cannot read this sandbox's watcher
        stranger = type(flat)(
            other.files._rpc,
            flat._watcher_id,
            other.connection_config,
            other.files._envd_version,
        )
        with pytest.raises(NotFoundException):
            stranger.get_new_events()
        flat.stop()
        with pytest.raises(SandboxException):
            flat.get_new_events()
        with pytest.raises(SandboxException):
            sbx.files.watch_dir(str(tmp_path / "renamed.txt"))
        metrics = httpx.get(server.url + "/metrics").text
        assert 'cleanroom_serve_watch_total{what="created"}' in metrics
    finally:
        sid = sbx.sandbox_id
        sbx.kill()
        other.kill()
    assert outcome(sid, FakeDriver()) == "completed"


def test_a_sandbox_has_at_most_so_many_watchers(key: str, tmp_path: Path) -> None:
    """Protects: the per-sandbox watcher limit (refused, typed), and a stopped watcher frees
    its place."""
    sbx = Sandbox.create("fake")
    try:
        handles = [sbx.files.watch_dir(str(tmp_path)) for _ in range(MAX_WATCHERS)]
        with pytest.raises(SandboxException, match="at most"):
            sbx.files.watch_dir(str(tmp_path))
        handles.pop().stop()
        handles.append(sbx.files.watch_dir(str(tmp_path)))
    finally:
        sbx.kill()


async def test_the_async_watch_dir_stream(key: str, tmp_path: Path) -> None:
    """Protects: ``watch_dir``'s stream starts, delivers events as the folder changes, stops on
    ``stop()``, and ends (``on_exit``) when its sandbox is killed."""
    sbx = await AsyncSandbox.create("fake")
    seen: list[FilesystemEvent] = []
    exits: list[Exception | None] = []
    handle = await sbx.files.watch_dir(str(tmp_path), seen.append, on_exit=exits.append)
    (tmp_path / "a.txt").write_text("a")
    await until(lambda: ("a.txt", "CREATE") in _seen(seen), "a.txt created")
    (tmp_path / "a.txt").unlink()
    await until(lambda: ("a.txt", "REMOVE") in _seen(seen), "a.txt removed")
    assert all(e.type in FilesystemEventType for e in seen)
    await handle.stop()  # type: ignore[no-untyped-call]
    assert exits == [None]

    second = await sbx.files.watch_dir(str(tmp_path), seen.append, on_exit=exits.append)
    await sbx.kill()
    await until(lambda: len(exits) == 2, "the watch ended with its sandbox", 60)
    await second.stop()  # type: ignore[no-untyped-call]
