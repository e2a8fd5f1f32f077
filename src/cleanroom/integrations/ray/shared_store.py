"""A run's store must be one every node reaches: a node-local folder is refused.

An object store URL (``s3://``, ``gs://``) is shared by construction. A folder is shared only if
every node sees the same one: the driver leaves a marker file in it (``mark``) and each node
looks for it (``check``) before its first episode; a node that does not find it refuses.
"""

from __future__ import annotations

import secrets

from cleanroom.errors import ConfigError
from cleanroom.store import LocalStore, Store

MARKERS = ".cluster"


def mark(store: Store) -> str | None:
    """Leave a fresh marker in a folder store; its name (None for an object store)."""
    if not isinstance(store, LocalStore):
        return None
    name = "node-check-" + secrets.token_hex(8)
    folder = store.root / MARKERS
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("cleanroom: every node of a cluster run must see this file\n")
    except OSError as exc:
        raise ConfigError(f"store {store.root}: cannot write there: {exc}") from exc
    return name


def check(store: Store, marker: str | None, node: str) -> None:
    """ConfigError unless this node sees the driver's marker in the same folder store."""
    if marker is None:
        return
    if not isinstance(store, LocalStore):
        raise ConfigError(f"node {node}: the driver's store is a folder, this node's is not")
    if not (store.root / MARKERS / marker).is_file():
        raise ConfigError(
            f"store {store.root} is not shared: node {node} does not see the driver's files "
            "there; give the run a store every node reaches (a shared mount, or s3://…)"
        )


def unmark(store: Store, marker: str | None) -> None:
    if marker is not None and isinstance(store, LocalStore):
        (store.root / MARKERS / marker).unlink(missing_ok=True)


__all__ = ["check", "mark", "unmark"]
