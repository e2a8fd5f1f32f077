"""Reads and writes inside an untrusted root tree, as if the tree were ``/``.

``InRoot(tree)`` turns guest paths (``/etc/passwd``) into host paths that stay inside ``tree``:
every symlink on the way is followed the way the guest would see it, with ``tree`` as ``/``
(``openat2``'s ``RESOLVE_IN_ROOT`` semantics, done component by component), and the last
component is never followed for a write: a write replaces whatever is there (a symlink, a FIFO,
a socket) with a new regular file. Reads take regular files only (a FIFO would block), at most
``limit`` bytes. The tree is edited by one process with no image code running (the build is
sequential), so a path checked here cannot change under it; and it runs in the build sandbox
(``confine.py``), so even a mistake here reaches no host file.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from cleanroom.errors import BuildError

MAX_SYMLINK_HOPS = 40
MAX_READ = 16 << 20


def split(guest: str | PurePosixPath) -> tuple[str, ...]:
    """The components of a guest path below ``/`` (``.`` dropped, ``..`` kept for resolving)."""
    return tuple(p for p in PurePosixPath(guest).parts if p not in ("/", "."))


def resolve_in_root(
    root: Path, parts: tuple[str, ...], where: str, *, follow_last: bool = False
) -> Path:
    """The host path of ``parts`` (a guest path) inside ``root``: symlinks on the way are
    followed as the guest would see them, never out of ``root`` (``..`` stops at it); the last
    part only if ``follow_last``. ``where`` names the source for errors."""
    resolved: list[str] = []
    pending = list(parts)
    hops = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        if part in ("", "."):
            continue
        here = root.joinpath(*resolved, part)
        if (pending or follow_last) and here.is_symlink():
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise BuildError(f"{where}: too many symlinks under /{'/'.join(parts)}")
            target = os.readlink(here)
            if target.startswith("/"):
                resolved = []
            pending = [p for p in target.split("/") if p] + pending
            continue
        resolved.append(part)
    return root.joinpath(*resolved)


def remove(path: Path) -> None:
    """Remove an entry (a folder with its contents; a symlink itself, never its target)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink()


class InRoot:
    """Guest-path operations on one tree (see the module docstring)."""

    def __init__(self, root: Path, where: str = "the image") -> None:
        self.root = root
        self.where = where

    def path(self, guest: str, *, follow_last: bool = True) -> Path:
        return resolve_in_root(self.root, split(guest), self.where, follow_last=follow_last)

    def folder(self, guest: str, mode: int = 0o755) -> Path:
        """The folder at ``guest``, made (with its parents) if missing; a non-folder in the
        way is a ``BuildError``."""
        current = self.root
        parts = split(guest)
        for i in range(len(parts)):
            current = resolve_in_root(self.root, parts[: i + 1], self.where, follow_last=True)
            try:
                st = os.lstat(current)
            except FileNotFoundError:  # a link may lead to a path whose parents are missing too
                current.mkdir(mode, parents=True)
                current.chmod(mode)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise BuildError(f"{self.where}: /{'/'.join(parts[: i + 1])} is not a folder")
        return current

    def entry(self, guest: str) -> Path:
        """Where a new entry ``guest`` goes: its parent resolved (made if missing), the last
        component not followed."""
        parts = split(guest)
        if not parts or parts[-1] == "..":
            raise BuildError(f"{self.where}: {guest!r} names no entry")
        return self.folder("/".join(parts[:-1])) / parts[-1]

    def read(self, guest: str, limit: int = MAX_READ) -> bytes | None:
        """The bytes of a regular file (at most ``limit``), or None if there is none."""
        path = self.path(guest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return f.read(limit)

    def write(self, guest: str, data: bytes, mode: int = 0o644) -> Path:
        """Replace ``guest`` (whatever it is) with a regular file holding ``data``."""
        path = self.entry(guest)
        remove(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        return path

    def copy_in(self, source: Path, guest: str, mode: int | None = None) -> Path:
        """Copy the host file ``source`` to ``guest`` (replacing what is there); mode 0755 if
        the source is executable, else 0644, unless given."""
        if mode is None:
            mode = 0o755 if os.stat(source).st_mode & 0o111 else 0o644
        path = self.entry(guest)
        remove(path)
        with open(source, "rb") as src:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        os.chmod(path, mode)
        return path

    def children(self, guest: str) -> Iterator[Path]:
        """The entries of the folder ``guest`` (none if it is not a folder)."""
        folder = self.path(guest)
        if folder.is_dir() and not folder.is_symlink():
            yield from sorted(folder.iterdir())

    def is_file(self, guest: str) -> bool:
        path = self.path(guest)
        return path.is_file() and not path.is_symlink()
