"""The image config's ``User``: resolved against the built tree, applied by a static helper.

``resolve_user(tree, spec, source)`` reads the tree's ``/etc/passwd`` and ``/etc/group`` (never
through a symlink out of the tree) the way ``docker run`` does: ``NAME``, ``UID``,
``NAME:GROUP``, ``UID:GID`` and the mixed forms. A name must exist in the image (else a
``BuildError`` naming the image); a numeric uid need not (its gid is then 0, its home ``/``). A
user without an explicit group gets the supplementary groups ``/etc/group`` lists it in. The
result, a ``RunAs``, is recorded in ``baseline.json`` (``image.run_as``); root (uid 0, no
explicit group) needs nothing and gives ``None``.

``rootfs.install_runas`` compiles ``runas.c`` (static, like the reseed helper) to
``RUNAS_PATH`` in the tree; ``RunAs.wrap(argv)`` is the argv the guest agent runs for an
entrypoint or a session command: the helper hands ``/run/cleanroom`` to the user, drops to it
and execs ``argv``.
"""

from __future__ import annotations

from pathlib import Path

from cleanroom.baseline.inroot import resolve_in_root
from cleanroom.core.run_as import RunAs
from cleanroom.errors import BuildError

RUNAS_SOURCE = Path(__file__).with_name("runas.c")
MAX_TABLE_BYTES = 4 << 20
"""Most bytes of an image's /etc/passwd or /etc/group that are read."""


def _table(tree: Path, name: str, source: str) -> list[list[str]]:
    """The lines of ``/etc/NAME`` in the tree, split on ``:`` (empty if it has none)."""
    path = resolve_in_root(tree, ("etc", name), source, follow_last=True)
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        data = f.read(MAX_TABLE_BYTES)
    lines = data.decode("utf-8", "replace").splitlines()
    return [line.split(":") for line in lines if line and not line.startswith("#")]


def _id(text: str) -> int | None:
    ok = text.isascii() and text.isdigit() and len(text) <= 10  # "²".isdigit() is True
    return int(text) if ok and int(text) < 2**32 - 1 else None


def _group_id(tables: list[list[str]], group: str, spec: str, source: str) -> int:
    found = next((f for f in tables if f[0] == group), None)
    gid = _id(found[2]) if found else _id(group)
    if gid is None:
        raise BuildError(f"image {source}: User {spec!r}: no group {group!r} in its /etc/group")
    return gid


def resolve_user(tree: Path, spec: str, source: str) -> RunAs | None:
    """The ``RunAs`` of the image config's ``User`` ``spec`` in ``tree``; None for root."""
    if not spec or spec in ("root", "0", "root:root", "0:0"):
        return None
    name, _, group = spec.partition(":")
    if not name:
        raise BuildError(f"image {source}: User {spec!r} names no user")
    passwd = [f for f in _table(tree, "passwd", source) if len(f) >= 4]
    entry = next((f for f in passwd if f[0] == name), None)
    if entry is None and _id(name) is not None:
        entry = next((f for f in passwd if f[2] == name), None)
    if entry is None and _id(name) is None:
        raise BuildError(f"image {source}: User {spec!r}: no user {name!r} in its /etc/passwd")
    uid, gid = (_id(entry[2]), _id(entry[3])) if entry else (_id(name), 0)
    if uid is None or gid is None:
        raise BuildError(f"image {source}: User {spec!r}: its /etc/passwd entry has bad ids")
    groups = [f for f in _table(tree, "group", source) if len(f) >= 3]
    extra: set[int] = set()
    if group:
        gid = _group_id(groups, group, spec, source)
    elif entry is not None:  # docker: the groups /etc/group lists the user in
        for f in groups:
            member_gid = _id(f[2])
            if len(f) >= 4 and entry[0] in f[3].split(",") and member_gid is not None:
                extra.add(member_gid)
    extra.discard(gid)
    if uid == 0 and gid == 0 and not extra:
        return None
    home = entry[5] if entry and len(entry) > 5 and entry[5] else "/"
    return RunAs(spec, uid, gid, (gid, *sorted(extra)), home)
