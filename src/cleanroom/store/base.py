"""The store's contract (``Store``) and the semantics every backend shares (``BaseStore``).

A backend implements five primitives (``_dest``, ``_exists``, ``_read``, ``_put``,
``_episode_ids``); ``BaseStore`` turns them into the rules: names are checked, the record is
written last and never replaced, a durable episode's files are never replaced with other bytes.
"""

from __future__ import annotations

import abc
import errno
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from cleanroom.errors import ExportError, RecordConflict, StoreError, UnsafePath

RECORD = "result.json"
RUN_FILES = "ledger"  # the one folder of run-level files, beside episodes/ (its hash chain)
CHUNK = 1 << 20
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
    def get_bytes(self, run_id: str, episode_id: str, rel: str) -> bytes | None: ...
    def episode_uri(self, run_id: str, episode_id: str) -> str: ...
    def run_uri(self, run_id: str) -> str: ...
    def list_records(self, run_id: str) -> list[dict[str, Any]]: ...


def safe_parts(rel: str) -> tuple[str, ...]:
    """The parts of a relative name; UnsafePath if absolute, empty, with '..', '.' or NUL."""
    parts = tuple(rel.split("/"))
    if not rel or "\x00" in rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"unsafe name in the store: {rel!r}")
    return parts


def one_part(value: str, what: str) -> str:
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


def record_bytes(record: dict[str, Any]) -> bytes:
    """The record exactly as ``put_record`` stores it (an attestation signs these bytes)."""
    return json.dumps(json.loads(canonical_json(record)), indent=1, sort_keys=True).encode() + b"\n"


def chunks(src: Path) -> Iterator[bytes]:
    with src.open("rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def digest(chunks: Iterable[bytes]) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    for chunk in chunks:
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def export_error(exc: OSError, where: object) -> ExportError:
    name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return ExportError(f"{name}: cannot write {where}: {exc.strerror or exc}")


class BaseStore(abc.ABC, Generic[_D]):
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

    def _run_dest(self, run_id: str, rel: str) -> _D:
        """Where a run-level file lies (``<root>/runs/<run_id>/<rel>``): its ledger chain."""
        raise NotImplementedError

    def _run_where(self, run_id: str, rel: str) -> _D:
        one_part(run_id, "run_id")
        parts = safe_parts(rel)
        if parts[0] != RUN_FILES or len(parts) < 2:
            raise UnsafePath(f"a run-level file lies under {RUN_FILES}/: {rel!r}")
        return self._run_dest(run_id, "/".join(parts))

    def put_run_bytes(self, run_id: str, rel: str, data: bytes) -> StoredFile:
        """Write (or replace: a resumed run's chain grows) a file of the run itself, confirmed."""
        stored = self._put(self._run_where(run_id, rel), bytes(data), exclusive=False)
        assert stored is not None
        return StoredFile(rel, *stored)

    def get_run_bytes(self, run_id: str, rel: str) -> bytes | None:
        """A run-level file's bytes (``ledger/events.jsonl``), None if absent."""
        return self._read(self._run_where(run_id, rel))

    def _where(self, run_id: str, episode_id: str, rel: str) -> _D:
        one_part(run_id, "run_id")
        one_part(episode_id, "episode_id")
        return self._dest(run_id, episode_id, "/".join(safe_parts(rel)))

    def _store(self, run_id: str, episode_id: str, rel: str, source: bytes | Path) -> StoredFile:
        if rel == RECORD:
            raise UnsafePath(f"{RECORD} is written only by put_record")
        dest = self._where(run_id, episode_id, rel)
        if self._exists(dest) and self._exists(self._where(run_id, episode_id, RECORD)):
            old = self._read(dest) or b""
            if not isinstance(source, bytes):
                source = read_source(source)
            if old != source:
                raise RecordConflict(f"{dest}: the episode is durable; refusing to replace {rel}")
            return StoredFile(rel, *digest([old]))
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
        data = record_bytes(record)
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

    def get_bytes(self, run_id: str, episode_id: str, rel: str) -> bytes | None:
        """A stored file's bytes (``logs/stderr.log``, ``attempts/2/logs/...``), None if absent."""
        return self._read(self._where(run_id, episode_id, rel))

    def episode_ids(self, run_id: str) -> list[str]:
        """Every episode folder of a run, sorted (durable or not; what an audit walks)."""
        one_part(run_id, "run_id")
        return sorted(self._episode_ids(run_id))

    def list_records(self, run_id: str) -> list[dict[str, Any]]:
        """Every durable record of a run, by episode_id."""
        one_part(run_id, "run_id")
        records = (self.get_record(run_id, e) for e in sorted(self._episode_ids(run_id)))
        return [r for r in records if r is not None]


def read_source(src: Path) -> bytes:
    try:
        return src.read_bytes()
    except OSError as exc:
        raise ExportError(f"cannot read {src}: {exc}") from exc
