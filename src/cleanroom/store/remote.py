"""``FsspecStore``: any fsspec URL (s3://, gs://, memory://); fsspec is an optional extra."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from cleanroom.errors import CleanroomError, ConfigError, ExportError, StoreError
from cleanroom.store.base import (
    CHUNK,
    RECORD,
    BaseStore,
    chunks,
    digest,
    one_part,
    read_source,
)


class FsspecStore(BaseStore[str]):
    """Any fsspec URL (``s3://bucket/prefix``, ``gs://…``, ``memory://…``); needs fsspec.

    Each object is written whole, its size confirmed with ``info()``. An exclusive write (the
    result record) is a conditional create: ``pipe_file(mode="create")``, which s3fs sends as
    ``PutObject`` with ``If-None-Match: *`` — two writers racing on one episode (a retry on
    another node while the first still finishes) cannot both win: the store refuses the second
    with 412, and the first record stays. Backends without conditional writes fall back to
    fsspec's check-then-write.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise ConfigError(
                f"the store {url!r} needs fsspec: pip install 'cleanroom[fsspec]'"
            ) from exc
        try:
            # its own filesystem object: a cached one may hold another endpoint (AWS_ENDPOINT_URL
            # and credentials are read when it is made)
            options = {"skip_instance_cache": True, **storage_options}
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot open the store {url!r}: {exc}") from exc
        self.url = url
        self.root = str(root).rstrip("/")

    def _dest(self, run_id: str, episode_id: str, rel: str) -> str:
        return f"{self.root}/runs/{run_id}/episodes/{episode_id}/{rel}"

    def _run_dest(self, run_id: str, rel: str) -> str:
        return f"{self.root}/runs/{run_id}/{rel}"

    def episode_uri(self, run_id: str, episode_id: str) -> str:
        dest = self._where(run_id, episode_id, RECORD)
        return str(self.fs.unstrip_protocol(dest.rsplit("/", 1)[0]))

    def run_uri(self, run_id: str) -> str:
        return str(self.fs.unstrip_protocol(f"{self.root}/runs/{one_part(run_id, 'run_id')}"))

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
            size, sha = digest([source] if isinstance(source, bytes) else chunks(source))
        except OSError as exc:
            raise ExportError(f"cannot read {exc.filename}: {exc}") from exc
        if exclusive and not isinstance(source, bytes):
            source = read_source(source)  # a conditional create takes the bytes
        ours = not exclusive  # an exclusive object may be removed only once we know it is ours
        try:
            self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            if exclusive:
                try:
                    self.fs.pipe_file(dest, source, mode="create")
                except FileExistsError:
                    return None  # another writer's object got there first: keep it
                ours = True
            elif isinstance(source, bytes):
                self.fs.pipe_file(dest, source)
            else:
                self.fs.put_file(str(source), dest)
            stored = self.fs.info(dest).get("size")
            if stored != size:
                raise ExportError(f"{dest}: stored size {stored}, wrote {size}")
            if isinstance(source, bytes) and len(source) <= CHUNK and self._read(dest) != source:
                raise ExportError(f"{dest}: stored bytes differ from what was written")
        except Exception as exc:
            if ours:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(dest)
            if isinstance(exc, CleanroomError):
                raise
            raise ExportError(f"{type(exc).__name__}: cannot write {dest}: {exc}") from exc
        return size, sha
