"""Tar archives of folders, packed and unpacked without trusting the archive.

``extract`` unpacks a tar stream into a folder: every member name must pass ``names.problem``
(after a leading ``./``), every folder on its way is opened without following links
(``O_NOFOLLOW`` relative to the folder above it), so no member lands outside the folder, even
through a link an earlier member made; a symbolic link's target must stay inside too, a hard
link must name a member inside; device nodes, FIFOs and other special files are refused; modes
keep their permission bits only (no setuid, setgid, sticky). A refused member is
``Failed("unsafe_path")``, a corrupt archive ``Failed("bad_archive")``; members before it stay
unpacked. ``pack`` writes a folder (regular files, folders, links; nothing else) as a tar
stream. Standard library only: the guest agent runs it, and the host may too.
"""

from __future__ import annotations

import contextlib
import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

if __package__:
    from cleanroom.agent import names
    from cleanroom.agent.handlers import Failed
else:  # in the guest, next to protocol.py
    import names  # type: ignore[import-not-found,no-redef]
    from handlers import Failed  # type: ignore[no-redef,import-not-found]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
COPY = 256 * 1024


class Stopped(Exception):
    """The receiver of a packed stream went away."""


def member_name(name: str) -> str | None:
    """The member's path relative to the folder (None: the folder itself), or Failed."""
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/") if name not in ("/", "") else name
    if name in ("", "."):
        return None
    why = names.problem(name)
    if why is not None:
        raise Failed("unsafe_path", why.format(what="tar member", shown=repr(name)))
    return name


def link_inside(rel: str, target: str) -> bool:
    """Does a symbolic link at ``rel`` pointing to ``target`` stay inside the folder?"""
    if not target or target.startswith("/") or any(names.bad_char(c) for c in target):
        return False
    depth = rel.count("/")  # the folders above the link, inside the root
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in ("", "."):
            depth += 1
    return True


def _walk(root: int, rel: str, create: bool) -> tuple[int, str]:
    """The folder holding ``rel`` (opened, no link followed; the caller closes it unless it
    is ``root``) and the last component of ``rel``."""
    *folders, leaf = rel.split("/")
    fd = root
    try:
        for part in folders:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise Failed(
                    "unsafe_path", f"tar member {rel!r}: {part!r} is not a folder"
                ) from exc
            if fd != root:
                os.close(fd)
            fd = child
    except BaseException:
        if fd != root:
            os.close(fd)
        raise
    return fd, leaf


def extract(stream: Any, dest: str) -> None:
    """Unpack the tar stream ``stream`` (a file to ``read``) into the folder ``dest``."""
    import tarfile

    os.makedirs(dest, exist_ok=True)
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                try:
                    _member(tar, member, root)
                except OSError as exc:  # a hard link to nothing, a file where a folder goes
                    why = f"tar member {member.name[:200]!r}: {exc.strerror}"
                    raise Failed("bad_archive", why) from exc
    except tarfile.TarError as exc:
        raise Failed("bad_archive", f"not a tar archive: {exc}") from exc
    finally:
        os.close(root)


def _member(tar: Any, member: Any, root: int) -> None:
    rel = member_name(member.name)
    if rel is None:
        return
    kind = "file" if member.isreg() else "folder" if member.isdir() else "link"
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise Failed("unsafe_path", f"tar member {rel!r} is a device node, FIFO or special file")
    mode = member.mode & 0o777
    parent, leaf = _walk(root, rel, create=True)
    try:
        if kind == "folder":
            try:
                os.mkdir(leaf, mode | 0o700, dir_fd=parent)
            except FileExistsError:
                os.close(os.open(leaf, DIR_FLAGS, dir_fd=parent))  # a folder, not a link
        elif kind == "file":
            _replace(parent, leaf)
            fd = os.open(leaf, FILE_FLAGS, 0o600, dir_fd=parent)
            try:
                source = tar.extractfile(member)
                while chunk := source.read(COPY):
                    os.write(fd, chunk)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        elif member.issym():
            if not link_inside(rel, member.linkname):
                target = member.linkname[:200]
                raise Failed("unsafe_path", f"tar link {rel!r} points outside: {target!r}")
            _replace(parent, leaf)
            os.symlink(member.linkname, leaf, dir_fd=parent)
        else:
            target = member_name(member.linkname)
            if target is None:
                raise Failed("unsafe_path", f"tar hard link {rel!r} names the folder itself")
            source_dir, source_leaf = _walk(root, target, create=False)
            try:
                _replace(parent, leaf)
                os.link(
                    source_leaf, leaf, src_dir_fd=source_dir, dst_dir_fd=parent,
                    follow_symlinks=False,
                )  # fmt: skip
            finally:
                if source_dir != root:
                    os.close(source_dir)
    finally:
        if parent != root:
            os.close(parent)


def _replace(parent: int, leaf: str) -> None:
    """Make room for a new file or link named ``leaf`` (never removing a folder)."""
    try:
        info = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise Failed("unsafe_path", f"tar member {leaf!r} would replace a folder")
    os.unlink(leaf, dir_fd=parent)


class _Sink:
    """A file-like ``write`` for tarfile onto a ``write(bytes) -> bool`` sink."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def write(self, data: bytes) -> int:
        if not self.sink.write(bytes(data)):
            raise Stopped
        return len(data)


def pack(src: str, sink: Any) -> None:
    """Write the folder ``src`` to ``sink`` as a tar stream (names relative to it, sorted);
    only regular files, folders and symbolic links. ``Stopped`` if the sink stops."""
    import tarfile

    if not os.path.isdir(src):
        raise Failed("not_found", f"no folder {src!r}")
    with tarfile.open(fileobj=_Sink(sink), mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(dirpath, name)
                mode = os.lstat(path).st_mode
                if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
                    tar.add(path, arcname=os.path.relpath(path, src), recursive=False)
