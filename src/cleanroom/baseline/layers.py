"""Apply OCI/Docker image layers to a root tree, with OCI semantics and without trusting them.

``apply_layer(tree, layer, name)`` extracts one layer tarball (plain, gzip, bzip2 or xz) onto
``tree`` in two passes: first its whiteouts (``.wh.NAME`` deletes ``NAME`` from the layers below;
``.wh..wh..opq`` empties its folder of what the layers below put there), then its entries.
Entries keep their mode, uid/gid, mtime and xattrs; hard links and symlinks are made as
recorded; device nodes are skipped. Nothing is ever written outside ``tree``: every path is
resolved inside it (``inroot``: a symlink is followed as if ``tree`` were ``/``, like
``openat2``'s ``RESOLVE_IN_ROOT``), a whiteout names an entry of its own folder and nothing
else, and a member whose name climbs out, or a layer over a limit (``ImageLimits``: bytes per
layer and per image, entries, path length, the scratch's free space; a sparse file counts at
its full size), is refused with an ``ImageError`` naming the layer, the member and the limit.
It runs inside the build sandbox (``confine.py``), never as host root.
"""

from __future__ import annotations

import contextlib
import lzma
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cleanroom.baseline.inroot import remove as _remove
from cleanroom.baseline.inroot import resolve_in_root
from cleanroom.errors import ImageError

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_PATH = 4096
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
FREE_RESERVE = 256 << 20
"""Bytes of the scratch no image may take (the erofs is written beside the tree)."""
MAX_ID = 65535
"""The highest uid or gid a member may have (the build sandbox maps ``0 .. 65535``)."""
ENTRY_COST = 512
"""Bytes an entry is counted for besides its content (inode, folder entry)."""


@dataclass(frozen=True)
class ImageLimits:
    """What unpacking an image may use. ``free_share``: the part of the scratch's free space
    the tree may take (the erofs, written beside it, needs about as much again)."""

    layer_bytes: int = 16 << 30
    image_bytes: int = 32 << 30
    entries: int = 1_000_000
    path_length: int = MAX_PATH
    free_share: float = 0.45


@dataclass
class Budget:
    """What is left of the limits while the layers of one image are applied."""

    limits: ImageLimits
    free: int
    used: int = 0
    entries: int = 0

    @classmethod
    def for_tree(cls, tree: Path, limits: ImageLimits) -> Budget:
        st = os.statvfs(tree)
        free = max(0, int((st.f_bavail * st.f_frsize - FREE_RESERVE) * limits.free_share))
        return cls(limits, free)

    def take(self, layer: str, member: str, size: int, layer_used: int) -> None:
        """Count one entry of ``size`` content bytes; ``ImageError`` past any limit."""
        cost = size + ENTRY_COST
        self.used += cost
        self.entries += 1
        checks = (
            (self.entries > self.limits.entries, f"more than {self.limits.entries} entries"),
            (layer_used + cost > self.limits.layer_bytes, f"over {self.limits.layer_bytes} bytes"),
            (self.used > self.limits.image_bytes, f"image over {self.limits.image_bytes} bytes"),
            (self.used > self.free, f"over the scratch's free space ({self.free} bytes usable)"),
        )
        for over, what in checks:
            if over:
                raise ImageError(f"image layer {layer}: {member!r}: unpacks to {what}")


@dataclass(frozen=True)
class LayerStats:
    """What applying one layer did."""

    files: int
    deleted: int
    skipped_devices: int
    size: int


def _parts(name: str, layer: str, path_length: int = MAX_PATH) -> tuple[str, ...]:
    """The member's path as components below the root; refuses ``..`` and overlong names."""
    if len(name.encode("utf-8", "surrogateescape")) > path_length or "\0" in name:
        raise ImageError(
            f"image layer {layer}: member name over {path_length} bytes or with NUL: {name[:80]!r}"
        )
    parts = tuple(p for p in PurePosixPath(name).parts if p not in ("/", "."))
    if ".." in parts:
        raise ImageError(f"image layer {layer}: member {name!r} escapes the root (..)")
    if any(len(p.encode("utf-8", "surrogateescape")) > 255 for p in parts):
        raise ImageError(f"image layer {layer}: member {name!r} has a component over 255 bytes")
    return parts


def _whiteout_target(parts: tuple[str, ...], name: str, layer: str) -> str:
    """The entry a ``.wh.NAME`` deletes: a plain name in its own folder, never ``.``, ``..``
    or the folder itself."""
    target = parts[-1][len(WHITEOUT) :]
    if target in ("", ".", "..") or "/" in target:
        raise ImageError(f"image layer {layer}: whiteout {name!r} names no entry of its folder")
    return target


def _empty_folder(folder: Path) -> int:
    if not folder.is_dir() or folder.is_symlink():
        return 0
    count = 0
    for child in folder.iterdir():
        _remove(child)
        count += 1
    return count


Blob = Path | int
"""A layer blob: a path, or a file descriptor open on it (how the build sandbox gets it)."""


@contextlib.contextmanager
def _open(layer: Blob, name: str) -> Iterator[tarfile.TarFile]:
    """The layer as a tar (plain or compressed; zstd is refused), closed afterwards."""
    try:
        f = os.fdopen(os.dup(layer), "rb") if isinstance(layer, int) else open(layer, "rb")  # noqa: SIM115
    except OSError as exc:
        raise ImageError(f"image layer {name}: cannot open ({exc})") from exc
    with f:
        try:
            f.seek(0)
            if f.read(4) == ZSTD_MAGIC:
                raise ImageError(f"image layer {name}: zstd-compressed layers are not supported")
            f.seek(0)
            tar = tarfile.open(fileobj=f, mode="r:*")  # noqa: SIM115 (closed below)
        except (tarfile.TarError, OSError, EOFError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ImageError(f"image layer {name}: not a readable tar ({first})") from exc
        with tar:
            yield tar


def _whiteouts(tree: Path, layer: Blob, name: str, limits: ImageLimits) -> int:
    """Pass 1: apply the layer's whiteouts to what the layers below left."""
    deleted = 0
    with _open(layer, name) as tar:
        try:
            for count, member in enumerate(tar):
                if count >= limits.entries:
                    raise ImageError(f"image layer {name}: more than {limits.entries} entries")
                parts = _parts(member.name, name, limits.path_length)
                if not parts or not parts[-1].startswith(WHITEOUT):
                    continue
                folder = resolve_in_root(tree, parts[:-1], name, follow_last=True)
                if parts[-1] == OPAQUE:
                    deleted += _empty_folder(folder)
                    continue
                target = folder / _whiteout_target(parts, member.name, name)
                if target.exists() or target.is_symlink():
                    _remove(target)
                    deleted += 1
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
            raise ImageError(f"image layer {name}: corrupt tar ({exc})") from exc
    return deleted


def _xattrs(member: tarfile.TarInfo) -> dict[str, bytes]:
    found = {}
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            found[key[len("SCHILY.xattr.") :]] = value.encode("utf-8", "surrogateescape")
    return found


def _finish(path: Path, member: tarfile.TarInfo, layer: str) -> None:
    """Owner, mode, xattrs and mtime as recorded (never through a symlink)."""
    if not (0 <= member.uid <= MAX_ID and 0 <= member.gid <= MAX_ID):
        raise ImageError(
            f"image layer {layer}: {member.name!r} is owned by {member.uid}:{member.gid}, "
            f"over the build's id limit {MAX_ID}"
        )
    os.lchown(path, member.uid, member.gid)
    if not member.issym():
        os.chmod(path, member.mode & 0o7777)
        for key, value in _xattrs(member).items():
            with contextlib.suppress(OSError):  # a filesystem without that namespace
                os.setxattr(path, key, value)
    os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


def _extract(tree: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> int:
    """One entry (pass 2); returns the bytes of content written."""
    parts = _parts(member.name, name)
    if not parts:
        return 0
    parent = resolve_in_root(tree, parts[:-1], name, follow_last=True)
    with contextlib.suppress(FileExistsError, NotADirectoryError):
        parent.mkdir(parents=True, exist_ok=True)
    if parent.is_symlink() or not parent.is_dir():
        raise ImageError(f"image layer {name}: parent of {member.name!r} is not a folder")
    path = parent / parts[-1]
    if member.isdir():
        if not path.is_dir() or path.is_symlink():
            _remove(path)
            path.mkdir()
        _finish(path, member, name)
        return 0
    _remove(path)
    if member.isreg():
        source = tar.extractfile(member)
        if source is None:
            raise ImageError(f"image layer {name}: cannot read {member.name!r}")
        with source, open(path, "xb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
        _finish(path, member, name)
        return member.size
    if member.issym():
        os.symlink(member.linkname, path)
        _finish(path, member, name)
    elif member.islnk():
        target = resolve_in_root(tree, _parts(member.linkname, name), name)
        if not target.is_file() or target.is_symlink():
            raise ImageError(f"image layer {name}: hard link {member.name!r} to a missing file")
        os.link(target, path)
    elif member.isfifo():
        os.mkfifo(path)
        _finish(path, member, name)
    return 0


def apply_layer(tree: Path, layer: Blob, name: str, budget: Budget | None = None) -> LayerStats:
    """Apply the layer tarball ``layer`` (``name``: its digest, for errors) onto ``tree``,
    counting what it unpacks against ``budget`` (one per image; default limits if None)."""
    budget = budget or Budget.for_tree(tree, ImageLimits())
    deleted = _whiteouts(tree, layer, name, budget.limits)
    files = skipped = size = 0
    with _open(layer, name) as tar:
        try:
            for member in tar:
                if PurePosixPath(member.name).name.startswith(WHITEOUT):
                    continue
                if member.ischr() or member.isblk():
                    skipped += 1
                    continue
                content = member.size if member.isreg() else 0
                budget.take(name, member.name, content, size)
                size += _extract(tree, tar, member, name)
                files += 1
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
            raise ImageError(f"image layer {name}: corrupt tar ({exc})") from exc
        except OSError as exc:
            raise ImageError(f"image layer {name}: cannot unpack ({exc})") from exc
    tree.chmod(stat.S_IMODE(tree.stat().st_mode) | 0o755)
    return LayerStats(files=files, deleted=deleted, skipped_devices=skipped, size=size)
