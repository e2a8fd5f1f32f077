"""The durable store: where an episode's evidence goes before its environment is destroyed.

Layout (the same for every backend)::

    <root>/runs/<run_id>/episodes/<episode_id>/
        result.json          the result record: written last, atomically, never replaced;
                             first writer wins, and it names the attempt that is the episode
        attempts/<n>/        everything attempt n wrote, and nothing another attempt wrote:
            artifacts/<name>     what the guest left in /run/cleanroom/out/
            logs/{stdout,stderr,console}.log ...
            verifier/{stdout,stderr}.log
            destroy.json, attempt.json (an attempt that did not reach a final outcome)
            attestation.dsse.json, destroy.dsse.json   signed statements (cleanroom.evidence)
    <root>/runs/<run_id>/ledger/
        events.jsonl, head.dsse.json   the run's ledger hash chain and its signed head

Readers follow the record (``layout.listed``: each file's ``path``); a record without paths
(record_version 1) is the old layout, ``artifacts/`` and ``logs/`` beside ``result.json``.

Every write is confirmed before it returns (``LocalStore``: temp file, fsync, rename, fsync the
folder, read back and re-hash; ``FsspecStore``: write, then check the stored size). A failed write
raises ``ExportError`` and leaves nothing half-written. Once ``result.json`` exists the episode is
durable: a different record is a ``RecordConflict``, and so is replacing one of its files with
different bytes. An artifact's content address is the (name, size, sha256) listed in the record.
"""

from __future__ import annotations

from pathlib import Path

from cleanroom.host import paths
from cleanroom.store.base import RECORD, Store, StoredFile, canonical_json, safe_parts
from cleanroom.store.local import LocalStore
from cleanroom.store.remote import FsspecStore

__all__ = [
    "RECORD",
    "FsspecStore",
    "LocalStore",
    "Store",
    "StoredFile",
    "canonical_json",
    "open_store",
    "safe_parts",
]


def open_store(dest: str | Path | None) -> Store:
    """None: the default local store; ``file://`` or a path: a folder; other URLs: fsspec."""
    if dest is None:
        return LocalStore(paths.store_dir())
    if isinstance(dest, str) and "://" in dest:
        if dest.startswith("file://"):
            return LocalStore(Path(dest.removeprefix("file://")))
        return FsspecStore(dest)
    return LocalStore(Path(dest))
