"""What the build writes into an image's tree, every path resolved inside it (``InRoot``).

Runs in the build sandbox (``intree``), from inputs the host staged (``rootfs.stage_inputs``):
the spec's ``[[files]]``, the guest agent, the image-``User`` helper, pip's wheels. ``scrub``
then removes or fixes everything host- or time-dependent and makes the folders the guest needs,
whatever the image left there (a symlink, a FIFO, a file where a folder should be).
"""

from __future__ import annotations

import fnmatch
import os
import stat
from pathlib import Path, PurePosixPath

from cleanroom.baseline.inroot import InRoot, remove
from cleanroom.errors import BuildError

SKIP_SUFFIXES = (".pyc",)
GUEST_FOLDERS = (
    ("dev", 0o755),
    ("proc", 0o555),
    ("sys", 0o555),
    ("run", 0o755),
    ("run/cleanroom", 0o755),
    ("root", 0o700),
    ("tmp", 0o1777),
    ("var/tmp", 0o1777),
)
"""Folders every baseline has (mount points and scratch), made if the image lacks them."""
SCRUBBED = (
    ("var/lib/apt/lists", "*"),
    ("var/cache/apt", "*.bin"),
    ("var/cache/apt/archives", "*.deb"),
    ("var/cache/ldconfig", "aux-cache"),
    ("var/lib/dpkg", "*-old"),
    ("var/cache/debconf", "*-old"),
    ("tmp", "*"),
    ("var/tmp", "*"),
    ("run", "*"),
)
"""``(folder, pattern)``: entries removed (a folder named ``partial`` stays: apt's)."""


def copy_tree_in(tree: InRoot, source: Path, dest: str) -> None:
    """Copy a staged folder's contents to the guest folder ``dest``: new folders 0755 (existing
    ones keep their mode), files 0755 if executable else 0644, symlinks as they are."""
    tree.folder(dest)
    for folder, dirs, files in os.walk(source):
        rel = PurePosixPath(dest) / Path(folder).relative_to(source).as_posix()
        dirs.sort()
        for name in dirs:
            guest = str(rel / name)
            if os.path.islink(os.path.join(folder, name)):
                _link_in(tree, Path(folder) / name, guest)
            elif not tree.path(guest).is_dir():
                tree.folder(guest)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for name in sorted(files):
            if name.endswith(SKIP_SUFFIXES):
                continue
            src = Path(folder) / name
            if src.is_symlink():
                _link_in(tree, src, str(rel / name))
            else:
                tree.copy_in(src, str(rel / name))


def _link_in(tree: InRoot, source: Path, guest: str) -> None:
    path = tree.entry(guest)
    remove(path)
    os.symlink(os.readlink(source), path)


def copy_file_in(tree: InRoot, source: Path, dest: str) -> None:
    """One staged file to ``dest`` (a folder there is an error: give a file path)."""
    existing = tree.path(dest)
    if existing.is_dir() and not existing.is_symlink():
        raise BuildError(f"files: {dest} is a folder in the image; give a file path")
    tree.copy_in(source, dest)


def install_wheels(tree: InRoot, staged: Path, site: str) -> None:
    """pip's staged ``--target`` folder into the guest's ``site`` folder; console scripts to
    ``/usr/local/bin`` with the guest's Python in the shebang."""
    scripts = staged / "bin"
    for entry in sorted(staged.iterdir()):
        if entry.name == "bin":
            continue
        if entry.is_dir() and not entry.is_symlink():
            copy_tree_in(tree, entry, f"{site}/{entry.name}")
        else:
            tree.copy_in(entry, f"{site}/{entry.name}", mode=0o644)
    if scripts.is_dir():
        for script in sorted(scripts.iterdir()):
            body = script.read_bytes()
            if body.startswith(b"#!") and b"python" in body.split(b"\n", 1)[0]:
                body = b"#!/usr/bin/python3\n" + body.split(b"\n", 1)[1]
            tree.write(f"/usr/local/bin/{script.name}", body, 0o755)


def scrub(tree: InRoot, apt_uid: int) -> None:
    """Remove or fix everything host- or time-dependent; make the folders the guest needs."""
    tree.folder("etc")
    for name, content in (("hostname", b"cleanroom\n"), ("resolv.conf", b""), ("machine-id", b"")):
        tree.write(f"etc/{name}", content, 0o644)
    if not tree.is_file("etc/environment"):
        tree.write("etc/environment", b"", 0o644)
    for folder, pattern in SCRUBBED:
        for path in tree.children(folder):
            keep = path.name == "partial" and path.is_dir() and not path.is_symlink()
            if fnmatch.fnmatchcase(path.name, pattern) and not keep:
                remove(path)
    for partial in ("var/cache/apt/archives/partial", "var/lib/apt/lists/partial"):
        path = tree.path(partial)
        if path.is_dir() and not path.is_symlink():  # apt leaves these root- or _apt-owned
            os.chown(path, apt_uid, 0)
            path.chmod(0o700)
    logs = tree.path("var/log")
    if logs.is_dir() and not logs.is_symlink():
        for folder, _dirs, files in os.walk(logs):  # os.walk does not enter linked folders
            for name in files:
                path = Path(folder) / name
                if stat.S_ISREG(os.lstat(path).st_mode):
                    with open(path, "r+b") as f:  # keep the file (owner, mode), not its text
                        f.truncate()
    for folder, mode in GUEST_FOLDERS:
        path = tree.path(folder, follow_last=False)
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            remove(path)
        tree.folder(folder, mode).chmod(mode)
