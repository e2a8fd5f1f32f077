"""The initramfs (``initrd.cpio``): busybox, the kernel modules, and ``/init`` (``init.sh``).

Written by a small pure-Python "newc" cpio writer, so the same inputs give the same bytes on any
host: entries sorted by name (parents first), every mtime 0, uid/gid 0, inode numbers assigned
in order, and no host state (umask, file owners, timestamps) leaking in. Uncompressed: the
kernel unpacks it fastest that way, and it is only a few MB.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from cleanroom.agent import native
from cleanroom.baseline.kernel import Kernel, split_for_nic
from cleanroom.baseline.pyinstall import AGENT_DEST
from cleanroom.baseline.spec import INIT_SCRIPT
from cleanroom.errors import BuildError

BUSYBOX = Path("/bin/busybox")
NATIVE_LAUNCH = (
    b"# the native agent (static): nothing from the image\n"
    b"exec $B switch_root /newroot /" + f"{AGENT_DEST}/{native.BINARY}".encode() + b"\n"
)
"""How ``init.sh`` ends: PID 1 goes to the static agent where the builder installs it."""
DIRS = ("bin", "dev", "lib", "lib/modules", "lower", "newroot", "proc", "sys", "upper")
TRAILER = "TRAILER!!!"


@dataclass(frozen=True)
class Entry:
    """One cpio member: a directory, regular file, symlink or device node."""

    name: str  # relative, no leading '/'
    mode: int  # full st_mode (type | permissions)
    data: bytes = b""  # file content, or the link target of a symlink
    rdev: tuple[int, int] = (0, 0)  # (major, minor) of a device node

    @classmethod
    def dir(cls, name: str, perm: int = 0o755) -> Entry:
        return cls(name, stat.S_IFDIR | perm)

    @classmethod
    def file(cls, name: str, data: bytes, perm: int = 0o644) -> Entry:
        return cls(name, stat.S_IFREG | perm, data)

    @classmethod
    def chardev(cls, name: str, major: int, minor: int, perm: int = 0o600) -> Entry:
        return cls(name, stat.S_IFCHR | perm, rdev=(major, minor))


def _pad(f: BinaryIO, written: int) -> None:
    f.write(b"\0" * (-written % 4))


def _header(f: BinaryIO, ino: int, entry: Entry, name: bytes) -> None:
    nlink = 2 if stat.S_ISDIR(entry.mode) else 1
    fields = (ino, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0, *entry.rdev, len(name) + 1, 0)
    header = b"070701" + b"".join(b"%08X" % value for value in fields)
    f.write(header + name + b"\0")
    _pad(f, len(header) + len(name) + 1)


def write_newc(entries: list[Entry], f: BinaryIO) -> None:
    """Write ``entries`` as a newc cpio archive (sorted; parents must be listed)."""
    names = [PurePosixPath(e.name) for e in entries]
    if len(set(names)) != len(names):
        raise BuildError("initramfs: duplicate entry names")
    present = set(names)
    for path in names:
        if path.is_absolute() or ".." in path.parts or str(path) in ("", "."):
            raise BuildError(f"initramfs: bad entry name {path}")
        if path.parent != PurePosixPath(".") and path.parent not in present:
            raise BuildError(f"initramfs: {path} has no parent directory entry")
    for ino, entry in enumerate(sorted(entries, key=lambda e: e.name.encode()), start=1):
        _header(f, ino, entry, entry.name.encode())
        f.write(entry.data)
        _pad(f, len(entry.data))
    _header(f, 0, Entry(TRAILER, 0), TRAILER.encode())


def init_script() -> bytes:
    """``/init``: ``init.sh``, which must end by handing PID 1 to the native agent at the path
    the builder installs it (``NATIVE_LAUNCH``)."""
    script = INIT_SCRIPT.read_bytes()
    if not script.endswith(NATIVE_LAUNCH):
        raise BuildError(f"initramfs: {INIT_SCRIPT} does not end by starting the native agent")
    return script


def initramfs_entries(kernel: Kernel, busybox: Path = BUSYBOX) -> list[Entry]:
    """What ``init.sh`` needs: busybox, the modules and their load order, and mount points."""
    if not busybox.is_file():
        raise BuildError(f"initramfs: {busybox} not found (install busybox-static)")
    entries = [Entry.dir(d) for d in DIRS]
    entries.append(Entry.chardev("dev/console", 5, 1))
    entries.append(Entry.file("init", init_script(), 0o755))
    entries.append(Entry.file("bin/busybox", busybox.read_bytes(), 0o755))
    for name in kernel.order:
        entries.append(Entry.file(f"lib/modules/{name}.ko", kernel.module(name).read_bytes()))
    always, nic = split_for_nic(kernel)  # a VM without a NIC skips virtio_net (~0.1 s)
    for file, names in (("order", always), ("order.nic", nic)):
        entries.append(Entry.file(f"lib/modules/{file}", "".join(f"{n}\n" for n in names).encode()))
    return entries


def build_initramfs(kernel: Kernel, out: Path, busybox: Path = BUSYBOX) -> None:
    """Write the baseline's ``initrd.cpio`` to ``out``."""
    entries = initramfs_entries(kernel, busybox)
    with out.open("wb") as f:
        write_newc(entries, f)
