"""The durable store: where an episode's evidence goes before its environment is destroyed.

Layout (the same for every backend)::

    <root>/runs/<run_id>/episodes/<episode_id>/
        result.json          the result record: written last, atomically, never replaced
        artifacts/<name>     what the guest left in /run/cleanroom/out/
        logs/{stdout,stderr,console}.log
        attempts/<n>/...     diagnostics of attempts that did not reach a final outcome

Every write is confirmed before it returns (``LocalStore``: temp file, fsync, rename, fsync the
folder, read back and re-hash; ``FsspecStore``: write, then check the stored size). A failed write
raises ``ExportError`` and leaves nothing half-written. Once ``result.json`` exists the episode is
durable: a different record is a ``RecordConflict``, and so is replacing one of its files with
different bytes. An artifact's content address is the (name, size, sha256) listed in the record.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import hashlib
import json
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from cleanroom import paths
from cleanroom.errors import (
    CleanroomError,
    ConfigError,
    ExportError,
    RecordConflict,
    StoreError,
    UnsafePath,
)

RECORD = "result.json"
_CHUNK = 1 << 20
_D = TypeVar("_D", Path, str)


@dataclass(frozen=True)
class StoredFile:
    """A file confirmed in the store: its name (relative to the episode folder) and address."""

    name: str
    size: int
    sha256: str


@runtime_checkable
class Store(Protocol):
    def put_file(self, run_id: str, episode_id: str, rel: str, src: Path) -> StoredFile: ...
    def put_bytes(self, run_id: str, episode_id: str, rel: str, data: bytes) -> StoredFile: ...
    def put_record(self, run_id: str, episode_id: str, record: dict[str, Any]) -> bool: ...
    def get_record(self, run_id: str, episode_id: str) -> dict[str, Any] | None: ...
    def episode_uri(self, run_id: str, episode_id: str) -> str: ...
    def run_uri(self, run_id: str) -> str: ...
    def list_records(self, run_id: str) -> list[dict[str, Any]]: ...


def safe_parts(rel: str) -> tuple[str, ...]:
    """The parts of a relative name; UnsafePath if absolute, empty, with '..', '.' or NUL."""
    parts = tuple(rel.split("/"))
    if not rel or "\x00" in rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"unsafe name in the store: {rel!r}")
    return parts


def _one_part(value: str, what: str) -> str:
    if len(safe_parts(value)) != 1:
        raise UnsafePath(f"{what} must be one path component: {value!r}")
    return value


def canonical_json(record: dict[str, Any]) -> bytes:
    """The canonical form two records are compared in (sorted keys, no spaces, no NaN)."""
    try:
        text = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"the result record is not valid JSON: {exc}") from exc
    return text.encode()


def _chunks(src: Path) -> Iterator[bytes]:
    with src.open("rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _digest(chunks: Iterable[bytes]) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    for chunk in chunks:
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def _export_error(exc: OSError, where: object) -> ExportError:
    name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return ExportError(f"{name}: cannot write {where}: {exc.strerror or exc}")


class _BaseStore(abc.ABC, Generic[_D]):
    """The store semantics, over five primitives each backend implements."""

    @abc.abstractmethod
    def _dest(self, run_id: str, episode_id: str, rel: str) -> _D: ...

    @abc.abstractmethod
    def _exists(self, dest: _D) -> bool: ...

    @abc.abstractmethod
    def _read(self, dest: _D) -> bytes | None: ...

    @abc.abstractmethod
    def _put(self, dest: _D, source: bytes | Path, *, exclusive: bool) -> tuple[int, str] | None:
        """Write and confirm; (size, sha256), or None if ``exclusive`` and ``dest`` exists."""

    @abc.abstractmethod
    def _episode_ids(self, run_id: str) -> list[str]: ...

    def _where(self, run_id: str, episode_id: str, rel: str) -> _D:
        _one_part(run_id, "run_id")
        _one_part(episode_id, "episode_id")
        return self._dest(run_id, episode_id, "/".join(safe_parts(rel)))

    def _store(self, run_id: str, episode_id: str, rel: str, source: bytes | Path) -> StoredFile:
        if rel == RECORD:
            raise UnsafePath(f"{RECORD} is written only by put_record")
        dest = self._where(run_id, episode_id, rel)
        if self._exists(dest) and self._exists(self._where(run_id, episode_id, RECORD)):
            old = self._read(dest) or b""
            if not isinstance(source, bytes):
                source = _read_source(source)
            if old != source:
                raise RecordConflict(f"{dest}: the episode is durable; refusing to replace {rel}")
            return StoredFile(rel, *_digest([old]))
        stored = self._put(dest, source, exclusive=False)
        assert stored is not None
        return StoredFile(rel, *stored)

    def put_file(self, run_id: str, episode_id: str, rel: str, src: Path) -> StoredFile:
        if not Path(src).is_file():
            raise ExportError(f"cannot read {src}: not a regular file")
        return self._store(run_id, episode_id, rel, Path(src))

    def put_bytes(self, run_id: str, episode_id: str, rel: str, data: bytes) -> StoredFile:
        return self._store(run_id, episode_id, rel, bytes(data))

    def put_record(self, run_id: str, episode_id: str, record: dict[str, Any]) -> bool:
        """Write the record (last, atomically). False if this same record is already there."""
        canonical = canonical_json(record)
        dest = self._where(run_id, episode_id, RECORD)
        data = json.dumps(json.loads(canonical), indent=1, sort_keys=True).encode() + b"\n"
        absent = self.get_record(run_id, episode_id) is None
        if absent and self._put(dest, data, exclusive=True) is not None:
            return True
        existing = self.get_record(run_id, episode_id)  # there, or we lost a race to it
        if existing is not None and canonical_json(existing) == canonical:
            return False
        raise RecordConflict(f"{dest}: a different result record already exists")

    def get_record(self, run_id: str, episode_id: str) -> dict[str, Any] | None:
        dest = self._where(run_id, episode_id, RECORD)
        raw = self._read(dest)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise StoreError(f"{dest}: unreadable result record: {exc}") from exc
        if not isinstance(data, dict):
            raise StoreError(f"{dest}: the result record is not a JSON object")
        return data

    def list_records(self, run_id: str) -> list[dict[str, Any]]:
        """Every durable record of a run, by episode_id."""
        _one_part(run_id, "run_id")
        records = (self.get_record(run_id, e) for e in sorted(self._episode_ids(run_id)))
        return [r for r in records if r is not None]


def _read_source(src: Path) -> bytes:
    try:
        return src.read_bytes()
    except OSError as exc:
        raise ExportError(f"cannot read {src}: {exc}") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: Path) -> None:
    """mkdir -p, fsyncing the parent of every folder it creates."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        _fsync_dir(folder.parent)


_NO_HARDLINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


class LocalStore(_BaseStore[Path]):
    """A folder on this host (the default: ``paths.store_dir()``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()

    def _dest(self, run_id: str, episode_id: str, rel: str) -> Path:
        return self.root / "runs" / run_id / "episodes" / episode_id / rel

    def episode_uri(self, run_id: str, episode_id: str) -> str:
        return self._where(run_id, episode_id, RECORD).parent.as_uri()

    def run_uri(self, run_id: str) -> str:
        return (self.root / "runs" / _one_part(run_id, "run_id")).as_uri()

    def _exists(self, dest: Path) -> bool:
        return dest.exists()

    def _read(self, dest: Path) -> bytes | None:
        try:
            return dest.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {dest}: {exc}") from exc

    def _episode_ids(self, run_id: str) -> list[str]:
        base = self.root / "runs" / run_id / "episodes"
        try:
            return [p.name for p in base.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"cannot list {base}: {exc}") from exc

    def _put(self, dest: Path, source: bytes | Path, *, exclusive: bool) -> tuple[int, str] | None:
        tmp = dest.parent / f".{dest.name[:100]}.{secrets.token_hex(6)}.tmp"
        placed = False
        try:
            _makedirs(dest.parent)
            h, size = hashlib.sha256(), 0
            with tmp.open("xb") as f:
                for chunk in [source] if isinstance(source, bytes) else _chunks(source):
                    f.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                if not _link_new(tmp, dest):
                    return None
            else:
                os.replace(tmp, dest)
            placed = True
            _fsync_dir(dest.parent)
            seen = _digest(_chunks(dest))
        except OSError as exc:
            if placed:
                dest.unlink(missing_ok=True)
            raise _export_error(exc, dest) from exc
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        if seen != (size, h.hexdigest()):
            with contextlib.suppress(OSError):
                dest.unlink()
            raise ExportError(f"{dest}: read back {seen}, wrote {(size, h.hexdigest())}; removed")
        return seen


def _link_new(tmp: Path, dest: Path) -> bool:
    """Place ``tmp`` at ``dest`` only if ``dest`` does not exist (atomically where possible)."""
    try:
        os.link(tmp, dest)
    except FileExistsError:
        return False
    except OSError as exc:  # a filesystem without hard links: check, then rename
        if exc.errno not in _NO_HARDLINKS:
            raise
        if dest.exists():
            return False
        os.replace(tmp, dest)
    return True


class FsspecStore(_BaseStore[str]):
    """Any fsspec URL (``s3://bucket/prefix``, ``gs://…``, ``memory://…``); needs fsspec.

    Object stores have no rename and no create-if-absent: each object is written whole, its size
    confirmed with ``info()``; a record is written only after checking none exists (two writers
    racing on one episode are not detected here; the controller owns each episode).
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise ConfigError(
                f"the store {url!r} needs fsspec: pip install 'cleanroom[fsspec]'"
            ) from exc
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot open the store {url!r}: {exc}") from exc
        self.url = url
        self.root = str(root).rstrip("/")

    def _dest(self, run_id: str, episode_id: str, rel: str) -> str:
        return f"{self.root}/runs/{run_id}/episodes/{episode_id}/{rel}"

    def episode_uri(self, run_id: str, episode_id: str) -> str:
        dest = self._where(run_id, episode_id, RECORD)
        return str(self.fs.unstrip_protocol(dest.rsplit("/", 1)[0]))

    def run_uri(self, run_id: str) -> str:
        return str(self.fs.unstrip_protocol(f"{self.root}/runs/{_one_part(run_id, 'run_id')}"))

    def _exists(self, dest: str) -> bool:
        try:
            return bool(self.fs.exists(dest))
        except Exception as exc:
            raise StoreError(f"cannot check {dest}: {exc}") from exc

    def _read(self, dest: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(dest))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise StoreError(f"cannot read {dest}: {exc}") from exc

    def _episode_ids(self, run_id: str) -> list[str]:
        base = f"{self.root}/runs/{run_id}/episodes"
        try:
            names = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise StoreError(f"cannot list {base}: {exc}") from exc
        return [str(n).rstrip("/").rsplit("/", 1)[-1] for n in names]

    def _put(self, dest: str, source: bytes | Path, *, exclusive: bool) -> tuple[int, str] | None:
        if exclusive and self._exists(dest):
            return None
        try:
            size, sha = _digest([source] if isinstance(source, bytes) else _chunks(source))
        except OSError as exc:
            raise ExportError(f"cannot read {exc.filename}: {exc}") from exc
        try:
            self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            if isinstance(source, bytes):
                self.fs.pipe_file(dest, source)
            else:
                self.fs.put_file(str(source), dest)
            stored = self.fs.info(dest).get("size")
            if stored != size:
                raise ExportError(f"{dest}: stored size {stored}, wrote {size}")
            if isinstance(source, bytes) and len(source) <= _CHUNK and self._read(dest) != source:
                raise ExportError(f"{dest}: stored bytes differ from what was written")
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.fs.rm_file(dest)
            if isinstance(exc, CleanroomError):
                raise
            raise ExportError(f"{type(exc).__name__}: cannot write {dest}: {exc}") from exc
        return size, sha


def open_store(dest: str | Path | None) -> Store:
    """None: the default local store; ``file://`` or a path: a folder; other URLs: fsspec."""
    if dest is None:
        return LocalStore(paths.store_dir())
    if isinstance(dest, str) and "://" in dest:
        if dest.startswith("file://"):
            return LocalStore(Path(dest.removeprefix("file://")))
        return FsspecStore(dest)
    return LocalStore(Path(dest))
