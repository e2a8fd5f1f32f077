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
fake and gvisor drivers' agent sockets) live in ``runtime_dir()``, a short per-home folder that
no other user can name first: under ``$XDG_RUNTIME_DIR`` when it is set, ours and private (no
one else can create anything there), else ``/tmp/cleanroom-<uid>-<random>``, its random name
kept in the home (``runtime-name``) and drawn again if another user holds it
(``private.runtime_dir``). A name derived from the home alone could be made first by anyone.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from pathlib import Path

RUNTIME_BASE = Path("/tmp")  # not $TMPDIR: that can be as long as a home
RUNTIME_NAME = "runtime-name"
"""The file in the home that keeps the name of its runtime folder under ``RUNTIME_BASE``."""
MAX_RUNTIME = 72
"""Characters of a runtime folder's path: ``/env-<16 hex>/ctl.sock`` after it stays well under
AF_UNIX's 108 bytes (a longer ``$XDG_RUNTIME_DIR`` is not used)."""
_NAME_RE = re.compile(r"cleanroom-[0-9]+-[0-9a-f]{24}\Z")


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
    """The short folder of this home's unix sockets (it may not exist yet): under a private
    ``$XDG_RUNTIME_DIR``, named by a hash of the home; else ``/tmp/<runtime_name()>``."""
    xdg = _xdg_runtime()
    if xdg is not None:
        digest = hashlib.sha256(os.fsencode(home())).hexdigest()[:16]
        return xdg / f"cleanroom-{digest}"
    return RUNTIME_BASE / runtime_name()


def _xdg_runtime() -> Path | None:
    """``$XDG_RUNTIME_DIR`` if it is an absolute, short folder of ours that only we can use."""
    value = os.environ.get("XDG_RUNTIME_DIR", "")
    if not value.startswith("/") or len(value) + len("/cleanroom-") + 16 > MAX_RUNTIME:
        return None
    try:
        info = os.lstat(value)
    except OSError:
        return None
    mine = info.st_uid == os.geteuid() and not info.st_mode & 0o077
    return Path(value) if stat.S_ISDIR(info.st_mode) and mine else None


def runtime_name() -> str:
    """The name of this home's folder under ``RUNTIME_BASE``: drawn at random once and kept in
    the home (another user cannot guess it, so cannot make it first)."""
    kept = home() / RUNTIME_NAME
    try:
        name = kept.read_text().strip()
    except FileNotFoundError:
        name = ""
    if _NAME_RE.match(name):
        return name
    return renew_runtime_name(name or None)


def renew_runtime_name(refused: str | None) -> str:
    """A new random runtime name, kept in the home in place of ``refused`` (None: of none);
    if another process kept a different one meanwhile, that one."""
    kept = home() / RUNTIME_NAME
    kept.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = f"cleanroom-{os.geteuid()}-{secrets.token_hex(12)}"
    draft = kept.with_name(f".{RUNTIME_NAME}.{secrets.token_hex(6)}")
    draft.write_text(name + "\n")
    try:
        if refused is None:
            try:
                os.link(draft, kept)  # the first name of this home: first writer wins
            except FileExistsError:
                return runtime_name()
        else:
            os.replace(draft, kept)
    finally:
        draft.unlink(missing_ok=True)
    return name
