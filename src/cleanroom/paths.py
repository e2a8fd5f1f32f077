"""Where cleanroom keeps things on the host.

Everything lives under ``$CLEANROOM_HOME`` (default ``~/.local/share/cleanroom``):

    baselines/<hex>/          content-addressed baselines (one folder per digest)
    baselines/by-spec/<hex>   spec digest -> baseline digest (the build cache)
    cache/                    downloads (kernel .debs) and build scratch
    store/                    the default durable store
    run/<driver>/<env_id>/    one folder per live environment (owner.json, pid, sockets)
    templates/<key>/          snapshot templates (guest RAM file + device state), read-only
    staging/<run>/            evidence in flight, host-private, removed after export
    ledger.db                 the audit ledger (SQLite, WAL)
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The root folder of all cleanroom state on this host."""
    env = os.environ.get("CLEANROOM_HOME")
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return (base / "cleanroom").resolve()


def baselines_dir() -> Path:
    return home() / "baselines"


def cache_dir() -> Path:
    return home() / "cache"


def store_dir() -> Path:
    return home() / "store"


def run_dir() -> Path:
    """Parent of every live environment's run folder."""
    return home() / "run"


def ledger_path() -> Path:
    return home() / "ledger.db"
