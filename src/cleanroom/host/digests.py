"""Content digests, and the stat signature that says when a file must be hashed again.

No cleanroom imports: manifests, baselines, templates and fork snapshots all name their content
the same way (``sha256:<hex>`` over canonical JSON, or a file's sha256).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

Signature = tuple[int, int, int, int, int]


def digest_of(identity_json: Any) -> str:
    """``sha256:<hex>`` over the canonical JSON (sorted keys, no spaces) of a value."""
    canonical = json.dumps(identity_json, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def signature(info: os.stat_result) -> Signature:
    """(device, inode, size, mtime, ctime; times in ns). User space cannot set a ctime, and every
    write or chmod moves it; a replacement is another inode. So an unchanged signature means an
    unchanged file (git trusts its index the same way)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
