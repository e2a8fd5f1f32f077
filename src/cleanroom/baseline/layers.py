"""Apply OCI/Docker image layers to a root tree, with OCI semantics and without trusting them.

``apply_layer(tree, layer, name)`` extracts one layer tarball (plain, gzip, bzip2 or xz) onto
``tree`` in two passes: first its whiteouts (``.wh.NAME`` deletes ``NAME`` from the layers below;
``.wh..wh..opq`` empties its folder of what the layers below put there), then its entries.
Entries keep their mode, uid/gid, mtime and xattrs; hard links and symlinks are made as
recorded; device nodes are skipped. Nothing is ever written outside ``tree``: every path is
resolved inside it (a symlink is followed as if ``tree`` were ``/``, like ``openat2``'s
``RESOLVE_IN_ROOT``), and a member whose name climbs out, or a layer over the size and entry
limits, is refused with a ``BuildError`` naming the layer and the member.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cleanroom.errors import BuildError

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_LAYER_BYTES = 32 << 30
"""Most bytes of file content one layer may unpack to."""
MAX_LAYER_ENTRIES = 2_000_000
MAX_PATH = 4096
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_SYMLINK_HOPS = 40


@dataclass(frozen=True)
class LayerStats:
    """What applying one layer did."""

    files: int
    deleted: int
    skipped_devices: int
    size: int


def _parts(name: str, layer: str) -> tuple[str, ...]:
    """The member's path as components below the root; refuses ``..`` and overlong names."""
    if len(name) > MAX_PATH or "\0" in name:
        raise BuildError(f"image layer {layer}: member name too long or has NUL: {name[:80]!r}")
    parts = tuple(p for p in PurePosixPath(name).parts if p not in ("/", "."))
    if ".." in parts:
        raise BuildError(f"image layer {layer}: member {name!r} escapes the root (..)")
    if any(len(p.encode()) > 255 for p in parts):
        raise BuildError(f"image layer {layer}: member {name!r} has a component over 255 bytes")
    return parts


def resolve_in_root(
    root: Path, parts: tuple[str, ...], layer: str, *, follow_last: bool = False
) -> Path:
    """The host path of ``parts`` (a guest path) inside ``root``: symlinks on the way are
    followed as the guest would see them, never out of ``root``; the last part only if
    ``follow_last``."""
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
                raise BuildError(f"image layer {layer}: too many symlinks under /{'/'.join(parts)}")
            target = os.readlink(here)
            if target.startswith("/"):
                resolved = []
            pending = [p for p in target.split("/") if p] + pending
            continue
        resolved.append(part)
    return root.joinpath(*resolved)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _empty_folder(folder: Path) -> int:
    if not folder.is_dir() or folder.is_symlink():
        return 0
    count = 0
    for child in folder.iterdir():
        _remove(child)
        count += 1
    return count


def _open(layer: Path, name: str) -> tarfile.TarFile:
    try:
        with open(layer, "rb") as f:
            if f.read(4) == ZSTD_MAGIC:
                raise BuildError(f"image layer {name}: zstd-compressed layers are not supported")
        return tarfile.open(layer, mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        first = str(exc).splitlines()[0]
        raise BuildError(f"image layer {name}: not a readable tar ({first})") from exc


def _whiteouts(tree: Path, layer: Path, name: str) -> int:
    """Pass 1: apply the layer's whiteouts to what the layers below left."""
    deleted = 0
    with _open(layer, name) as tar:
        for count, member in enumerate(tar):
            if count >= MAX_LAYER_ENTRIES:
                raise BuildError(f"image layer {name}: more than {MAX_LAYER_ENTRIES} entries")
            parts = _parts(member.name, name)
            if not parts or not parts[-1].startswith(WHITEOUT):
                continue
            folder = resolve_in_root(tree, parts[:-1], name, follow_last=True)
            if parts[-1] == OPAQUE:
                deleted += _empty_folder(folder)
                continue
            target = folder / parts[-1][len(WHITEOUT) :]
            if target.exists() or target.is_symlink():
                _remove(target)
                deleted += 1
    return deleted


def _xattrs(member: tarfile.TarInfo) -> dict[str, bytes]:
    found = {}
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            found[key[len("SCHILY.xattr.") :]] = value.encode("utf-8", "surrogateescape")
    return found


def _finish(path: Path, member: tarfile.TarInfo) -> None:
    """Owner, mode, xattrs and mtime as recorded (never through a symlink)."""
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
    parent.mkdir(parents=True, exist_ok=True)
    if parent.is_symlink() or not parent.is_dir():
        raise BuildError(f"image layer {name}: parent of {member.name!r} is not a folder")
    path = parent / parts[-1]
    if member.isdir():
        if not path.is_dir() or path.is_symlink():
            _remove(path)
            path.mkdir()
        _finish(path, member)
        return 0
    _remove(path)
    if member.isreg():
        source = tar.extractfile(member)
        if source is None:
            raise BuildError(f"image layer {name}: cannot read {member.name!r}")
        with source, open(path, "xb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
        _finish(path, member)
        return member.size
    if member.issym():
        os.symlink(member.linkname, path)
        _finish(path, member)
    elif member.islnk():
        target = resolve_in_root(tree, _parts(member.linkname, name), name)
        if not target.is_file() or target.is_symlink():
            raise BuildError(f"image layer {name}: hard link {member.name!r} to a missing file")
        os.link(target, path)
    elif member.isfifo():
        os.mkfifo(path)
        _finish(path, member)
    return 0


def apply_layer(tree: Path, layer: Path, name: str) -> LayerStats:
    """Apply the layer tarball ``layer`` (``name``: its digest, for errors) onto ``tree``."""
    deleted = _whiteouts(tree, layer, name)
    files = skipped = size = 0
    with _open(layer, name) as tar:
        try:
            for member in tar:
                if PurePosixPath(member.name).name.startswith(WHITEOUT):
                    continue
                if member.ischr() or member.isblk():
                    skipped += 1
                    continue
                size += _extract(tree, tar, member, name)
                files += 1
                if size > MAX_LAYER_BYTES:
                    raise BuildError(f"image layer {name}: unpacks to over {MAX_LAYER_BYTES} bytes")
        except (tarfile.TarError, EOFError) as exc:
            raise BuildError(f"image layer {name}: corrupt tar ({exc})") from exc
    tree.chmod(stat.S_IMODE(tree.stat().st_mode) | 0o755)
    return LayerStats(files=files, deleted=deleted, skipped_devices=skipped, size=size)
