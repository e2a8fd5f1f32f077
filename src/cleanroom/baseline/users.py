"""The unprivileged user every baseline has: ``agent`` (uid and gid 1000, home /home/agent).

Commands run as root unless asked otherwise (``env.exec(..., user="agent")``); an agent rollout
that should not own the guest runs as this user. A tree that already has a user ``agent`` keeps
it as it is; one whose uid 1000 is taken (an image's own user) gets the next free id. The
entries are appended to ``/etc/passwd``, ``/etc/group`` and (if present) ``/etc/shadow``, with
the password locked, so a build stays byte-for-byte repeatable.
"""

from __future__ import annotations

import os
from pathlib import Path

from cleanroom.errors import BuildError

NAME = "agent"
UID = 1000
HOME = "/home/agent"


def _entries(path: Path) -> list[list[str]]:
    if not path.is_file() or path.is_symlink():
        return []
    return [line.split(":") for line in path.read_text(errors="replace").splitlines() if line]


def _append(path: Path, line: str) -> None:
    if path.is_symlink():
        raise BuildError(f"files: /etc/{path.name} is a link; cannot add the user {NAME!r}")
    text = path.read_text(errors="replace") if path.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    path.write_text(text + line + "\n")
    path.chmod(mode)


def add_agent_user(rootfs: Path) -> int:
    """Give the tree the user ``agent`` (see the module docstring); returns its uid."""
    etc = rootfs / "etc"
    passwd, group = etc / "passwd", etc / "group"
    if not etc.is_symlink():  # FROM scratch: no /etc at all (unpack_image refuses a link)
        etc.mkdir(mode=0o755, exist_ok=True)
    users = _entries(passwd)
    for fields in users:
        if fields[0] == NAME and len(fields) > 2 and fields[2].isdigit():
            return int(fields[2])
    taken = {int(f[2]) for f in users + _entries(group) if len(f) > 2 and f[2].isdigit()}
    uid = UID
    while uid in taken:
        uid += 1
    if not users:
        _append(passwd, "root:x:0:0:root:/root:/bin/sh")
    shell = "/bin/bash" if (rootfs / "bin" / "bash").exists() else "/bin/sh"
    _append(passwd, f"{NAME}:x:{uid}:{uid}:cleanroom agent:{HOME}:{shell}")
    if not any(fields[0] == NAME for fields in _entries(group)):
        _append(group, f"{NAME}:x:{uid}:")
    if (etc / "shadow").is_file():
        _append(etc / "shadow", f"{NAME}:!:::::::")  # locked: no password login
    homes = rootfs / "home"
    if homes.is_symlink():
        raise BuildError(f"files: /home is a link; cannot make {HOME}")
    homes.mkdir(mode=0o755, exist_ok=True)
    home = homes / NAME
    home.mkdir(mode=0o755, exist_ok=True)
    os.chown(home, uid, uid)
    return uid
