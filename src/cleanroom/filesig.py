"""A file's stat signature: what moves whenever its content may have changed."""

from __future__ import annotations

import os

Signature = tuple[int, int, int, int, int]


def signature(info: os.stat_result) -> Signature:
    """(device, inode, size, mtime, ctime; times in ns). User space cannot set a ctime, and every
    write or chmod moves it; a replacement is another inode. So an unchanged signature means an
    unchanged file (git trusts its index the same way)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
