"""Everything cleanroom keeps on the host is private to the user it runs as.

``$CLEANROOM_HOME`` and the runtime folder are 0700 folders owned by us: one that is missing is
made so; one that exists must be a real folder (not a link) that we own and that no one else can
write, and is then narrowed to 0700. Anything else is refused with a ``PrivacyError``, never
used: a folder another user made first (say in ``/tmp``) could hold their files or links.
``restrict_umask`` (called by the CLI and the API at start) makes every file and folder created
later 0600/0700.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from cleanroom.errors import PrivacyError
from cleanroom.host import paths

UMASK = 0o077


def restrict_umask() -> None:
    """Narrow this process's umask to owner-only (it is never widened)."""
    os.umask(os.umask(UMASK) | UMASK)


def private_dir(path: Path) -> Path:
    """``path`` as a folder only we can use (made if missing, with its parents); PrivacyError
    if it is a link, not a folder, owned by another user, or writable by group or others."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PrivacyError(path, f"cannot be made ({exc.strerror})") from exc
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise PrivacyError(path, f"cannot be read ({exc.strerror})") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise PrivacyError(path, "is not a folder (a link or a file)")
    if info.st_uid != os.geteuid():
        raise PrivacyError(path, f"is owned by uid {info.st_uid}, not {os.geteuid()}")
    if info.st_mode & 0o022:
        raise PrivacyError(path, f"is writable by group or others (mode {info.st_mode & 0o777:o})")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def check_home() -> Path:
    """The home, made or checked private (the CLI and the API call this at start)."""
    restrict_umask()
    return private_dir(paths.home())


def check_home_or_exit() -> None:
    """``check_home`` for the CLI (its root callback): a refused home is one line on stderr
    and exit status 2, like every other bad setting."""
    try:
        check_home()
    except PrivacyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def runtime_dir() -> Path:
    """The runtime folder of this home's sockets, made or checked private. One under
    ``/tmp`` that is not ours to use (another user made a folder or link of that name) is left
    alone and a new random name is drawn (``paths.renew_runtime_name``)."""
    path = paths.runtime_dir()
    for _ in range(3):
        try:
            return private_dir(path)
        except PrivacyError:
            if path.parent != paths.RUNTIME_BASE:  # under $XDG_RUNTIME_DIR: only ours to make
                raise
            path = paths.RUNTIME_BASE / paths.renew_runtime_name(path.name)
    return private_dir(path)
