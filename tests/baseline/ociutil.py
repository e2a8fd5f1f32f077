"""Test helper: make layer tarballs and OCI layouts / docker archives from plain Python data.

A layer is a list of ``Entry``; ``layout(folder, layers, config)`` writes a valid OCI image layout
(blobs, manifest, index) so that tests exercise the real parsers on images they built themselves.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Entry:
    name: str
    kind: str = "file"  # file | dir | symlink | hardlink | chardev | fifo
    data: bytes = b""
    link: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    xattrs: dict[str, str] = field(default_factory=dict)


KINDS = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chardev": tarfile.CHRTYPE,
    "fifo": tarfile.FIFOTYPE,
}


def layer_bytes(entries: list[Entry], gzip: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gzip else "w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = KINDS[e.kind]
            info.mode = e.mode
            info.uid, info.gid = e.uid, e.gid
            info.mtime = 1_700_000_000
            info.linkname = e.link
            if e.xattrs:
                info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            if e.kind == "file":
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _put(blobs: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def layout(
    folder: Path, layers: list[bytes], config: dict[str, Any] | None = None, tag: str = "latest"
) -> Path:
    """An OCI image layout of ``layers`` (tar bytes, bottom first) at ``folder``."""
    blobs = folder / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    plain = [gzip.decompress(x) if x[:2] == b"\x1f\x8b" else x for x in layers]
    diff_ids = ["sha256:" + hashlib.sha256(x).hexdigest() for x in plain]
    conf = {
        "architecture": "amd64",
        "os": "linux",
        "config": config or {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    config_desc = _put(blobs, json.dumps(conf).encode())
    layer_descs = [
        {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_put(blobs, x)} for x in layers
    ]
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
        "layers": layer_descs,
    }
    manifest_desc = _put(blobs, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **manifest_desc,
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (folder / "index.json").write_text(json.dumps(index))
    (folder / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return folder


def tar_folder(folder: Path, out: Path) -> Path:
    """``folder``'s contents as a tar (an oci-archive of a layout)."""
    with tarfile.open(out, "w") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return out
