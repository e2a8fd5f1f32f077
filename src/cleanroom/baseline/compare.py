"""``cleanroom baseline diff A B``: what changed between two baselines, as lines a person reads.

Locks first (Debian packages, wheels, kernel, image: ``lock.diff``), then the baseline's own
fields (entrypoint, limits, network), then the root filesystems file by file (both erofs images
extracted with ``fsck.erofs`` into scratch folders, compared by type, mode, owner, size and
sha256), capped at ``MAX_FILE_LINES`` lines.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

from cleanroom.baseline.lock import diff as lock_diff
from cleanroom.baseline.proc import run
from cleanroom.baseline.rootfs import scratch_parent
from cleanroom.core.baseline_model import Baseline

MAX_FILE_LINES = 200
FIELDS = ("entrypoint", "limits", "network", "kernel_version", "agent_version", "function")


def _tree(root: Path) -> dict[str, str]:
    """Every path below ``root`` -> a short description of what it is."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            rel = "/" + str(path.relative_to(root))
            what = f"{stat.filemode(info.st_mode)} {info.st_uid}:{info.st_gid}"
            if stat.S_ISLNK(info.st_mode):
                what += f" -> {os.readlink(path)}"
            elif stat.S_ISREG(info.st_mode):
                with open(path, "rb") as f:
                    what += f" {info.st_size} {hashlib.file_digest(f, 'sha256').hexdigest()[:16]}"
            found[rel] = what
    return found


def _files(a: Baseline, b: Baseline) -> list[str]:
    if a.components_by_name("rootfs.erofs") == b.components_by_name("rootfs.erofs"):
        return []
    scratch = Path(tempfile.mkdtemp(prefix="cleanroom-diff-", dir=scratch_parent()))
    try:
        trees = []
        for side, baseline in (("a", a), ("b", b)):
            run(["fsck.erofs", f"--extract={scratch / side}", baseline.rootfs], "diff")
            trees.append(_tree(scratch / side))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ta, tb = trees
    lines = []
    for path in sorted(set(ta) | set(tb)):
        if path not in tb:
            lines.append(f"file - {path}")
        elif path not in ta:
            lines.append(f"file + {path}")
        elif ta[path] != tb[path]:
            lines.append(f"file ~ {path}: {ta[path]} -> {tb[path]}")
    if len(lines) > MAX_FILE_LINES:
        lines = [*lines[:MAX_FILE_LINES], f"... and {len(lines) - MAX_FILE_LINES} more files"]
    return lines


def compare(a: Baseline, b: Baseline) -> list[str]:
    """Every difference from ``a`` to ``b`` (empty: the same baseline)."""
    if a.digest == b.digest:
        return []
    lines = lock_diff(a.lock or {}, b.lock or {})
    ja, jb = a.identity(), b.identity()
    lines += [f"{k}: {ja.get(k)} -> {jb.get(k)}" for k in FIELDS if ja.get(k) != jb.get(k)]
    return lines + _files(a, b)
