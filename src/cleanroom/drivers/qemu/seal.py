"""Sealing a qemu fork snapshot: its files frozen at once, hashed while its clones restore.

Sealing comes after the parent was destroyed and confirmed absent, in two steps, so that clones
need not wait for the hash (~0.1-0.25 s of CPU for ~100 MiB of RAM file here). ``freeze`` makes
the files read-only and takes their stat signature (``digests.signature``; a few ms); ``start``
then computes the digest over both files' content in a thread (``hash_files``: the RAM file in
1 MiB chunks, holes without reading them) while clones restore. The guarantee stays what it
was, that every clone's digest names the bytes it was restored from:
  - a file's content cannot change without its mtime or ctime moving (write, truncate, a
    mapping written back; resetting mtime moves ctime), so an unchanged signature means
    unchanged bytes (to the file system's timestamp granularity, as before);
  - ``hash_files`` stats the files again once hashed: if the signature moved, the hash may mix
    old and new bytes, so the seal fails and no digest is recorded (before, a change during
    the hash went unnoticed: the signature was taken after it);
  - ``fork.Forks.clone`` checks the signature before restoring, then, once restored, waits for
    the seal (``Seals.sealed``) and checks it again (``check_unchanged``): the files were the frozen
    ones from the freeze to the end of both the hash and this clone's load, so it loaded the
    hashed bytes (and the pages it reads later come from the same unchanged file). Only then
    is the env returned; if the seal failed or a file changed, the clone is destroyed and
    LaunchError raised, so no episode runs on a snapshot whose digest is unknown or differs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from cleanroom.drivers import snapshot
from cleanroom.drivers.base import ForkSnapshot
from cleanroom.errors import DriverError, LaunchError
from cleanroom.host import digests
from cleanroom.host.digests import digest_of, sha256_file

META_FILE = "snapshot.json"
CHUNK = 1 << 20
_ZERO_CHUNK = hashlib.sha256(bytes(CHUNK)).digest()


def content_digest(path: Path) -> str:
    """sha256 over the sha256 of each 1 MiB chunk (a hole's chunk hash is known: not read)."""
    outer = hashlib.sha256()
    with path.open("rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        outer.update(size.to_bytes(8, "big"))
        for offset in range(0, size, CHUNK):
            n = min(CHUNK, size - offset)
            try:
                data_at = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data from here on
                data_at = size
            if data_at >= offset + n and n == CHUNK:
                outer.update(_ZERO_CHUNK)
            else:
                outer.update(hashlib.sha256(os.pread(fd, n, offset)).digest())
    return "sha256:" + outer.hexdigest()


def signature(path: Path) -> dict[str, list[int]]:
    return {name: list(digests.signature((path / name).stat())) for name in snapshot.FILES}


def changed_since(path: Path, frozen: dict[str, list[int]]) -> list[str]:
    """The snapshot files whose signature is no longer the frozen one."""
    now = signature(path)
    return [name for name in snapshot.FILES if now[name] != frozen[name]]


def freeze(path: Path) -> dict[str, Any]:
    """Make the files read-only; their signature and sizes (what ``hash_files`` will cover)."""
    for name in snapshot.FILES:
        (path / name).chmod(0o444)
    return {
        "signature": signature(path),
        "ram_bytes": (path / snapshot.RAM_FILE).stat().st_blocks * 512,
        "state_bytes": (path / snapshot.STATE_FILE).stat().st_size,
    }


def hash_files(path: Path, frozen: dict[str, Any]) -> dict[str, Any]:
    """Hash the frozen files, check they did not change meanwhile, write ``snapshot.json``."""
    files = {
        snapshot.RAM_FILE: content_digest(path / snapshot.RAM_FILE),
        snapshot.STATE_FILE: "sha256:" + sha256_file(path / snapshot.STATE_FILE),
    }
    changed = changed_since(path, frozen["signature"])
    if changed:
        raise DriverError(f"snapshot {path.name} changed while sealed ({', '.join(changed)})")
    meta = {
        "digest": digest_of(files),
        "files": files,
        **frozen,
    }
    (path / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return meta


class Seals:
    """The fork snapshots one driver is sealing (or sealed): their hash, by snapshot id."""

    def __init__(self) -> None:
        self.hashing: dict[str, asyncio.Future[dict[str, Any]]] = {}

    def start(self, snapshot_id: str, path: Path, frozen: dict[str, Any], since: float) -> None:
        """Hash the frozen files in a thread; ``sealed`` waits for it (``seal_s``: from
        ``since``)."""

        async def seal() -> dict[str, Any]:
            meta = await asyncio.to_thread(hash_files, path, frozen)
            return {**meta, "seal_s": round(time.monotonic() - since, 4)}

        hashing = asyncio.ensure_future(seal())
        hashing.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved
        self.hashing[snapshot_id] = hashing

    def forget(self, snapshot_id: str) -> None:
        self.hashing.pop(snapshot_id, None)

    def sealing(self, snap: ForkSnapshot) -> bool:
        """Whether ``snap`` is sealed or being sealed here (else it can never be)."""
        return snap.digest is not None or snap.snapshot_id in self.hashing

    async def sealed(self, snap: ForkSnapshot) -> ForkSnapshot:
        """``snap`` once hashed: its digest, file digests and ``seal_s`` (DriverError if the
        files changed while they were hashed)."""
        if snap.digest is not None:
            return snap
        hashing = self.hashing.get(snap.snapshot_id)
        if hashing is None:
            raise DriverError(f"snapshot {snap.snapshot_id} is not being sealed by this driver")
        meta = await asyncio.shield(hashing)  # shared by every clone: one cancelled cancels none
        return dataclasses.replace(snap, digest=meta["digest"], facts={**snap.facts, **meta})


async def check_unchanged(snap: ForkSnapshot) -> None:
    """LaunchError unless the snapshot's files still have the signature they were frozen with."""
    assert snap.path is not None
    try:
        changed = await asyncio.to_thread(changed_since, snap.path, snap.facts["signature"])
    except OSError as exc:
        raise LaunchError(f"snapshot {snap.snapshot_id} is gone: {exc}") from exc
    if changed:
        raise LaunchError(f"snapshot {snap.snapshot_id} was modified ({', '.join(changed)})")
