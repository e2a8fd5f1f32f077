"""The durable store: atomic, confirmed writes; idempotent records; safe names; full disks."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.errors import ConfigError, ExportError, RecordConflict, UnsafePath
from cleanroom.store import FsspecStore, LocalStore, Store, StoredFile, open_store
from cleanroom.store import local as store_mod

RUN, EP = "run-1", "ep-1"
RECORD: dict[str, Any] = {"episode_id": EP, "run_id": RUN, "outcome": "completed", "reward": 1.5}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _episode(store: LocalStore, episode_id: str = EP) -> Path:
    return store.root / "runs" / RUN / "episodes" / episode_id


def _enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_put_file_records_the_sha256_of_the_content(store: LocalStore, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # more than one chunk
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    stored = store.put_file(RUN, EP, "artifacts/sub/dir/out.bin", src)
    assert stored == StoredFile(
        "artifacts/sub/dir/out.bin", len(data), hashlib.sha256(data).hexdigest()
    )
    assert (_episode(store) / "artifacts/sub/dir/out.bin").read_bytes() == data
    small = store.put_bytes(RUN, EP, "logs/stdout.log", b"hello\n")
    assert small.sha256 == hashlib.sha256(b"hello\n").hexdigest() and small.size == 6
    assert isinstance(store, Store)


def test_record_roundtrip_list_and_uri(store: LocalStore) -> None:
    assert store.get_record(RUN, EP) is None
    assert store.list_records(RUN) == []
    assert store.put_record(RUN, "ep-2", {**RECORD, "episode_id": "ep-2"}) is True
    assert store.put_record(RUN, EP, RECORD) is True
    assert store.get_record(RUN, EP) == RECORD
    assert [r["episode_id"] for r in store.list_records(RUN)] == [EP, "ep-2"]
    assert store.episode_uri(RUN, EP) == _episode(store).as_uri()
    assert store.run_uri(RUN) == (store.root / "runs" / RUN).as_uri()
    with pytest.raises(UnsafePath):
        store.episode_uri(RUN, "")


def test_same_record_twice_is_a_noop_without_rewrite(store: LocalStore) -> None:
    assert store.put_record(RUN, EP, RECORD) is True
    path = _episode(store) / "result.json"
    before = path.stat()
    reordered = dict(reversed(list(RECORD.items())))
    assert store.put_record(RUN, EP, reordered) is False
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )
    assert _tree(_episode(store)) == {"result.json"}


def test_a_different_record_is_a_conflict_and_the_original_stays(store: LocalStore) -> None:
    store.put_record(RUN, EP, RECORD)
    raw = (_episode(store) / "result.json").read_bytes()
    with pytest.raises(RecordConflict):
        store.put_record(RUN, EP, {**RECORD, "reward": 0.0})
    assert (_episode(store) / "result.json").read_bytes() == raw
    assert store.get_record(RUN, EP) == RECORD


def test_a_record_that_is_not_json_is_an_export_error(store: LocalStore) -> None:
    with pytest.raises(ExportError, match="not valid JSON"):
        store.put_record(RUN, EP, {"reward": float("nan")})
    assert store.get_record(RUN, EP) is None


def test_files_of_a_durable_episode_are_not_replaced(store: LocalStore) -> None:
    first = store.put_bytes(RUN, EP, "artifacts/a.txt", b"one")
    store.put_record(RUN, EP, RECORD)
    assert store.put_bytes(RUN, EP, "artifacts/a.txt", b"one") == first
    with pytest.raises(RecordConflict):
        store.put_bytes(RUN, EP, "artifacts/a.txt", b"two")
    assert (_episode(store) / "artifacts/a.txt").read_bytes() == b"one"
    store.put_bytes(RUN, EP, "attempts/1/destroy.json", b"{}")  # new files are fine


def test_a_durable_episodes_files_exported_again_unchanged_are_no_ops(
    store: LocalStore, tmp_path: Path
) -> None:
    """Protects a retried export after the record (a resume, a crash after the record): the same
    file again, from a path or empty, is the file already stored, not a RecordConflict."""
    src = tmp_path / "out.bin"
    src.write_bytes(b"evidence")
    first = store.put_file(RUN, EP, "artifacts/out.bin", src)
    empty = store.put_bytes(RUN, EP, "logs/stderr.log", b"")
    store.put_record(RUN, EP, RECORD)
    assert store.put_file(RUN, EP, "artifacts/out.bin", src) == first
    assert store.put_bytes(RUN, EP, "logs/stderr.log", b"") == empty
    src.write_bytes(b"changed")
    with pytest.raises(RecordConflict):
        store.put_file(RUN, EP, "artifacts/out.bin", src)


@pytest.mark.parametrize(
    "rel",
    [
        "",
        "/etc/passwd",
        "../x",
        "artifacts/../../x",
        "a//b",
        "a/",
        "./a",
        "a/./b",
        "a\x00b",
        "..",
        "result.json",
    ],
)
def test_unsafe_names_are_refused(store: LocalStore, rel: str) -> None:
    with pytest.raises(UnsafePath):
        store.put_bytes(RUN, EP, rel, b"x")
    assert not store.root.exists() or _tree(store.root) == set()


@pytest.mark.parametrize(("run_id", "episode_id"), [("..", EP), (RUN, "a/b"), ("", EP), (RUN, "/")])
def test_unsafe_ids_are_refused(store: LocalStore, run_id: str, episode_id: str) -> None:
    with pytest.raises(UnsafePath):
        store.put_bytes(run_id, episode_id, "logs/x", b"x")
    with pytest.raises(UnsafePath):
        store.put_record(run_id, episode_id, RECORD)


def test_failed_fsync_leaves_no_partial_file(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put_bytes(RUN, EP, "logs/stdout.log", b"durable")
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(ExportError, match="ENOSPC"):
        store.put_bytes(RUN, EP, "artifacts/big.bin", b"x" * 4096)
    with pytest.raises(ExportError, match="ENOSPC"):
        store.put_record(RUN, EP, RECORD)
    monkeypatch.undo()
    assert _tree(_episode(store)) == {"logs/stdout.log"}  # no temp file, no partial file
    assert (_episode(store) / "logs/stdout.log").read_bytes() == b"durable"
    assert store.get_record(RUN, EP) is None


def test_failed_rename_keeps_the_previous_version(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put_bytes(RUN, EP, "logs/stdout.log", b"old")
    monkeypatch.setattr(os, "replace", _enospc)
    with pytest.raises(ExportError, match="ENOSPC") as info:
        store.put_bytes(RUN, EP, "logs/stdout.log", b"new")
    assert "logs/stdout.log" in str(info.value)
    monkeypatch.undo()
    assert _tree(_episode(store)) == {"logs/stdout.log"}
    assert (_episode(store) / "logs/stdout.log").read_bytes() == b"old"


def test_failure_after_rename_removes_the_unconfirmed_file(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def eio(path: Path) -> None:
        raise OSError(errno.EIO, "I/O error")

    store.put_bytes(RUN, EP, "logs/a", b"a")  # creates the folders first
    monkeypatch.setattr(store_mod, "_fsync_dir", eio)
    with pytest.raises(ExportError, match="EIO"):
        store.put_record(RUN, EP, RECORD)
    monkeypatch.undo()
    assert store.get_record(RUN, EP) is None
    assert _tree(_episode(store)) == {"logs/a"}


def test_read_back_mismatch_is_an_export_error(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def corrupt(src: Path) -> Iterator[bytes]:
        yield b"bit rot"

    monkeypatch.setattr(store_mod, "chunks", corrupt)  # used to read the written file back
    with pytest.raises(ExportError, match="read back"):
        store.put_bytes(RUN, EP, "artifacts/a", b"payload")
    assert not (_episode(store) / "artifacts/a").exists()


def _can_mount() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("mount") is not None


def test_real_full_disk_is_an_export_error(tmp_path: Path) -> None:
    if not _can_mount():
        pytest.skip("needs root and mount(8) to create a small tmpfs")
    root = tmp_path / "tiny"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"mount not permitted here: {mounted.stderr.strip()}")
    try:
        store = LocalStore(root)
        store.put_record(RUN, "earlier", {**RECORD, "episode_id": "earlier"})
        big = tmp_path / "big.bin"
        big.write_bytes(os.urandom(2 * 1024 * 1024))
        with pytest.raises(ExportError, match="ENOSPC"):
            store.put_file(RUN, EP, "artifacts/big.bin", big)
        assert store.get_record(RUN, "earlier") == {**RECORD, "episode_id": "earlier"}
        assert _tree(root) == {f"runs/{RUN}/episodes/earlier/result.json"}  # nothing partial
        store.put_bytes(RUN, EP, "logs/stdout.log", b"space was given back")
    finally:
        subprocess.run(["umount", str(root)], check=False)


def test_open_store_picks_the_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    default = open_store(None)
    assert isinstance(default, LocalStore) and default.root == (tmp_path / "home/store").resolve()
    by_url = open_store(f"file://{tmp_path}/s")
    assert isinstance(by_url, LocalStore) and by_url.root == (tmp_path / "s").resolve()
    assert isinstance(open_store(str(tmp_path / "p")), LocalStore)
    assert isinstance(open_store(tmp_path / "p"), LocalStore)


def test_fsspec_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ConfigError, match=r"pip install 'cleanroom\[fsspec\]'"):
        open_store("s3://bucket/prefix")


# -- fsspec (memory://) -----------------------------------------------------------------------


@pytest.fixture
def mem() -> Iterator[FsspecStore]:
    pytest.importorskip("fsspec")
    url = f"memory://cleanroom-test-{uuid.uuid4().hex}"
    store = open_store(url)
    assert isinstance(store, FsspecStore)
    yield store
    with contextlib.suppress(FileNotFoundError):
        store.fs.rm(store.root, recursive=True)


def test_fsspec_store_semantics(mem: FsspecStore, tmp_path: Path) -> None:
    src = tmp_path / "a.bin"
    src.write_bytes(b"artifact")
    stored = mem.put_file(RUN, EP, "artifacts/x/a.bin", src)
    assert stored.sha256 == hashlib.sha256(b"artifact").hexdigest() and stored.size == 8
    assert mem.fs.cat_file(f"{mem.root}/runs/{RUN}/episodes/{EP}/artifacts/x/a.bin") == b"artifact"
    assert mem.put_bytes(RUN, EP, "logs/stdout.log", b"out").size == 3
    assert mem.get_record(RUN, EP) is None
    assert mem.put_record(RUN, EP, RECORD) is True
    assert mem.put_record(RUN, EP, dict(reversed(list(RECORD.items())))) is False
    with pytest.raises(RecordConflict):
        mem.put_record(RUN, EP, {**RECORD, "outcome": "timeout"})
    assert mem.get_record(RUN, EP) == RECORD
    assert [r["episode_id"] for r in mem.list_records(RUN)] == [EP]
    assert mem.list_records("other-run") == []
    assert mem.episode_uri(RUN, EP).startswith("memory://")
    assert mem.episode_uri(RUN, EP).startswith(mem.run_uri(RUN) + "/episodes/")
    with pytest.raises(UnsafePath):
        mem.put_bytes(RUN, EP, "../escape", b"x")


def test_fsspec_size_mismatch_is_an_export_error(
    mem: FsspecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = f"{mem.root}/runs/{RUN}/episodes/{EP}/artifacts/a"
    real_info = mem.fs.info

    def lying_info(path: str, **kw: Any) -> dict[str, Any]:
        info: dict[str, Any] = real_info(path, **kw)
        return {**info, "size": 1} if path == dest else info

    monkeypatch.setattr(mem.fs, "info", lying_info)
    with pytest.raises(ExportError, match="stored size"):
        mem.put_bytes(RUN, EP, "artifacts/a", b"four")
    monkeypatch.undo()
    assert not mem.fs.exists(dest)


def test_fsspec_backend_failure_is_an_export_error(
    mem: FsspecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mem.fs, "pipe_file", _enospc)
    with pytest.raises(ExportError, match="OSError"):
        mem.put_record(RUN, EP, RECORD)
    monkeypatch.undo()
    assert mem.get_record(RUN, EP) is None
