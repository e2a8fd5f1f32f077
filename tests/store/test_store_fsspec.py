"""``FsspecStore``'s own promises, on fsspec's local (``file://``) and ``memory://`` filesystems.

Where objects land (under the URL's path, whatever its trailing slash), what its addresses are,
that a record is created only once and removed again if it was ours and could not be confirmed,
that every small write is read back, and that each failure is a typed error naming the object.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.errors import ConfigError, ExportError, RecordConflict, StoreError, UnsafePath
from cleanroom.store.base import CHUNK
from cleanroom.store.remote import FsspecStore

pytest.importorskip("fsspec")

RUN, EP = "run-1", "ep-1"
RECORD: dict[str, Any] = {"episode_id": EP, "run_id": RUN, "outcome": "completed", "reward": 1.0}


@pytest.fixture
def mem() -> Iterator[FsspecStore]:
    store = FsspecStore(f"memory://cleanroom-fsspec-{uuid.uuid4().hex}")
    yield store
    if store.fs.exists(store.root):
        store.fs.rm(store.root, recursive=True)


def _boom(*args: object, **kwargs: object) -> Any:
    raise RuntimeError("backend down")


@pytest.mark.parametrize("slash", ["", "/"])
def test_objects_land_under_the_url_path(
    tmp_path: Path, slash: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: a store writes exactly under its URL's folder (nested folders made as needed),
    with or without a trailing slash, never relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "store"
    url = f"file://{root}{slash}"
    store = FsspecStore(url)
    assert store.url == url
    src = tmp_path / "a.bin"
    src.write_bytes(b"artifact")
    store.put_file(RUN, EP, "artifacts/deep/er/a.bin", src)
    store.put_bytes(RUN, EP, "logs/stdout.log", b"out")
    assert store.put_record(RUN, EP, RECORD) is True
    episode = root / "runs" / RUN / "episodes" / EP
    assert (episode / "artifacts/deep/er/a.bin").read_bytes() == b"artifact"
    assert (episode / "logs/stdout.log").read_bytes() == b"out"
    assert (episode / "result.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "store"]  # nothing elsewhere
    assert store.episode_uri(RUN, EP) == f"file://{episode}"
    assert store.run_uri(RUN) == f"file://{root}/runs/{RUN}"
    again = FsspecStore(f"file://{root}")
    assert again.get_record(RUN, EP) == RECORD
    assert [r["episode_id"] for r in again.list_records(RUN)] == [EP]


def test_unknown_protocol_is_a_config_error_naming_the_url() -> None:
    """Protects: a store URL fsspec cannot open is a ConfigError that names the URL."""
    with pytest.raises(ConfigError, match=r"cannot open the store 'nosuchproto://b/p'"):
        FsspecStore("nosuchproto://b/p")


def test_storage_options_reach_the_filesystem(tmp_path: Path) -> None:
    """Protects: the caller's storage options are passed to fsspec (here the local filesystem's
    ``auto_mkdir``), and each store gets its own filesystem object, never a cached one (a cached
    s3 filesystem may hold another endpoint or credentials)."""
    a = FsspecStore(f"file://{tmp_path}", auto_mkdir=False)
    b = FsspecStore(f"file://{tmp_path}", auto_mkdir=False)
    assert a.fs.auto_mkdir is False
    assert a.fs is not b.fs


def test_run_uri_refuses_a_run_id_with_a_slash(mem: FsspecStore) -> None:
    """Protects: a run id that is not one path component is refused, naming the field."""
    with pytest.raises(UnsafePath, match="run_id must be one path component"):
        mem.run_uri("a/b")


def test_backend_failures_are_store_errors_naming_the_object(
    mem: FsspecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: a failing backend's exists/read/list is a StoreError naming the path."""
    episode = f"{mem.root}/runs/{RUN}/episodes/{EP}"
    monkeypatch.setattr(mem.fs, "exists", _boom)
    with pytest.raises(StoreError, match=f"cannot check {episode}/logs/x: backend down"):
        mem.put_bytes(RUN, EP, "logs/x", b"x")
    monkeypatch.setattr(mem.fs, "cat_file", _boom)
    with pytest.raises(StoreError, match=f"cannot read {episode}/result.json: backend down"):
        mem.get_record(RUN, EP)
    monkeypatch.setattr(mem.fs, "ls", _boom)
    with pytest.raises(StoreError, match=f"cannot list {mem.root}/runs/{RUN}/episodes: backend"):
        mem.list_records(RUN)


def test_durable_artifact_is_never_replaced(mem: FsspecStore) -> None:
    """Protects: once the record is there, an artifact with other bytes is refused (the store
    must see that both exist), and the same bytes are a no-op."""
    mem.put_bytes(RUN, EP, "artifacts/a", b"first")
    mem.put_record(RUN, EP, RECORD)
    with pytest.raises(RecordConflict, match="refusing to replace artifacts/a"):
        mem.put_bytes(RUN, EP, "artifacts/a", b"other")
    assert mem.put_bytes(RUN, EP, "artifacts/a", b"first").size == 5
    assert mem.get_bytes(RUN, EP, "artifacts/a") == b"first"


def test_record_already_there_is_kept(mem: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Protects: the record is a conditional create. A second writer that passed the
    existence checks (it lost the race) never overwrites the first record: it sees
    RecordConflict, and the first record stays whole."""
    assert mem.put_record(RUN, EP, RECORD) is True
    real_read = mem._read
    reads = {"n": 0}

    def late(dest: str) -> bytes | None:  # the first look misses the other writer's record
        reads["n"] += 1
        return None if reads["n"] == 1 else real_read(dest)

    monkeypatch.setattr(mem, "_read", late)
    monkeypatch.setattr(mem, "_exists", lambda dest: False)
    with pytest.raises(RecordConflict):
        mem.put_record(RUN, EP, {**RECORD, "reward": 0.0})
    monkeypatch.undo()
    assert mem.get_record(RUN, EP) == RECORD


def test_an_unconfirmed_record_of_ours_is_removed(
    mem: FsspecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: a record we created but could not confirm (its stored size differs) is removed
    again, so no half-confirmed record is ever read as durable; the error is an ExportError even
    when the removal fails too."""
    dest = f"{mem.root}/runs/{RUN}/episodes/{EP}/result.json"
    real_info = mem.fs.info
    monkeypatch.setattr(
        mem.fs, "info", lambda p, **kw: {**real_info(p, **kw), "size": 1} if p == dest else {}
    )
    with pytest.raises(ExportError, match="stored size 1"):
        mem.put_record(RUN, EP, RECORD)
    assert not mem.fs.exists(dest)
    monkeypatch.setattr(mem.fs, "rm_file", _boom)
    with pytest.raises(ExportError, match="stored size 1"):
        mem.put_record(RUN, EP, RECORD)


@pytest.mark.parametrize("size", [10, CHUNK])
def test_small_writes_are_read_back(
    mem: FsspecStore, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """Protects: every write of up to one chunk (1 MiB included) is read back and compared; a
    store that kept other bytes of the same size is an ExportError naming the object."""
    real_cat = mem.fs.cat_file
    monkeypatch.setattr(mem.fs, "cat_file", lambda p, **kw: b"y" * len(real_cat(p, **kw)))
    with pytest.raises(ExportError, match=r"artifacts/a: stored bytes differ"):
        mem.put_bytes(RUN, EP, "artifacts/a", b"x" * size)


def test_unreadable_source_is_an_export_error_naming_it(
    mem: FsspecStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: a source file that cannot be read while it is stored is an ExportError that
    names the file."""
    src = tmp_path / "gone.bin"
    src.write_bytes(b"x")

    def vanish(path: Path) -> Iterator[bytes]:
        raise FileNotFoundError(2, "No such file or directory", str(path))
        yield b""  # pragma: no cover

    monkeypatch.setattr("cleanroom.store.remote.chunks", vanish)
    with pytest.raises(ExportError, match=f"cannot read {src}"):
        mem.put_file(RUN, EP, "artifacts/gone.bin", src)


def test_listing_with_trailing_slashes(mem: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Protects: a backend that lists folders with a trailing slash (gcsfs, some s3 servers)
    still yields each episode id whole (one ending in "X" too): every durable record is listed."""
    mem.put_record(RUN, "ep-X", {**RECORD, "episode_id": "ep-X"})
    real_ls = mem.fs.ls
    monkeypatch.setattr(
        mem.fs, "ls", lambda p, detail=False: [f"{n}/" for n in real_ls(p, detail=False)]
    )
    assert [r["episode_id"] for r in mem.list_records(RUN)] == ["ep-X"]
