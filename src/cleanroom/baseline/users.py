"""The unprivileged user every baseline has: ``agent`` (uid and gid 1000, home /home/agent).

Commands run as root unless asked otherwise (``env.exec(..., user="agent")``); an agent rollout
that should not own the guest runs as this user. A tree that already has a user ``agent`` keeps
it as it is; one whose uid 1000 is taken (an image's own user) gets the next free id. The
entries are appended to ``/etc/passwd``, ``/etc/group`` and (if present) ``/etc/shadow``, with
the password locked, so a build stays byte-for-byte repeatable. An image without an
``/etc/passwd`` gets one with ``root`` and ``agent``. Every path is resolved inside the tree
(``InRoot``): a table that is a symlink, a FIFO or a folder is the image's mistake, replaced.
"""

from __future__ import annotations

import os

from cleanroom.baseline.inroot import InRoot

NAME = "agent"
UID = 1000
HOME = "/home/agent"
MAX_TABLE = 4 << 20


def _text(tree: InRoot, guest: str) -> str:
    data = tree.read(guest, MAX_TABLE)
    return data.decode("utf-8", "surrogateescape") if data else ""


def _entries(text: str) -> list[list[str]]:
    return [line.split(":") for line in text.splitlines() if line]


def _append(tree: InRoot, guest: str, line: str) -> None:
    text = _text(tree, guest)
    path = tree.path(guest, follow_last=False)
    regular = path.is_file() and not path.is_symlink()
    mode = path.stat().st_mode & 0o7777 if regular else 0o644
    owner = (path.stat().st_uid, path.stat().st_gid) if regular else (0, 0)
    if text and not text.endswith("\n"):
        text += "\n"
    written = tree.write(guest, (text + line + "\n").encode("utf-8", "surrogateescape"), mode)
    os.chown(written, *owner)


def add_agent_user(tree: InRoot) -> int:
    """Give the tree the user ``agent`` (see the module docstring); returns its uid."""
    users = _entries(_text(tree, "etc/passwd"))
    groups = _entries(_text(tree, "etc/group"))
    for fields in users:
        if fields[0] == NAME and len(fields) > 2 and fields[2].isdigit():
            return int(fields[2])
    taken = {int(f[2]) for f in users + groups if len(f) > 2 and f[2].isascii() and f[2].isdigit()}
    uid = UID
    while uid in taken:
        uid += 1
    if not users:
        _append(tree, "etc/passwd", "root:x:0:0:root:/root:/bin/sh")
    shell = "/bin/bash" if tree.path("bin/bash").exists() else "/bin/sh"
    _append(tree, "etc/passwd", f"{NAME}:x:{uid}:{uid}:cleanroom agent:{HOME}:{shell}")
    if not groups:
        _append(tree, "etc/group", "root:x:0:")
    if not any(fields[0] == NAME for fields in groups):
        _append(tree, "etc/group", f"{NAME}:x:{uid}:")
    if tree.is_file("etc/shadow"):
        _append(tree, "etc/shadow", f"{NAME}:!:::::::")  # locked: no password login
    home = tree.folder(HOME)
    home.chmod(0o755)
    os.chown(home, uid, uid)
    return uid
