"""Where cleanroom keeps things on the host.

Everything lives under ``$CLEANROOM_HOME`` (default ``~/.local/share/cleanroom``):

    baselines/<hex>/          content-addressed baselines (one folder per digest)
    baselines/by-spec/<hex>   spec digest -> baseline digest (the build cache)
    cache/                    downloads (kernel .debs) and build scratch
    store/                    the default durable store
    run/<driver>/<env_id>/    one folder per live environment (owner.json, pid)
    templates/<key>/          snapshot templates (guest RAM file + device state), read-only
    staging/<run>/            evidence in flight, host-private, removed after export
    ledger.db                 the audit ledger (SQLite, WAL)

Unix sockets do not live there: an AF_UNIX path must fit in 108 bytes and a home can be any
length. QEMU's sockets are socket pairs passed by descriptor; the few that need a path (the
fake and gvisor drivers' agent sockets) live in ``runtime_dir()``, a short per-user folder named
by a hash of the home (made and checked by ``private.runtime_dir``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

RUNTIME_BASE = Path("/tmp")  # not $TMPDIR: that can be as long as a home


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


def runtime_dir() -> Path:
    """The short folder of this home's unix sockets: ``/tmp/cleanroom-<uid>-<hash of home>``."""
    digest = hashlib.sha256(os.fsencode(home())).hexdigest()[:16]
    return RUNTIME_BASE / f"cleanroom-{os.geteuid()}-{digest}"
