"""Move a baseline between hosts as one file: ``export_baseline`` / ``import_baseline``.

The file is a plain tar archive: ``baseline.json`` first, then every component (``vmlinux``,
``initrd.cpio``, ``rootfs.erofs``, ...) as a regular file, with fixed owners and times so the
same baseline always exports to the same bytes. A baseline is re-hashed before it is exported
(a drifted one is refused).

Import trusts nothing in the file: only regular files named in ``baseline.json`` are accepted
(no links, folders, or other names), every component's size and sha256 is recomputed while it is
unpacked, and the digest is recomputed from the identity; any mismatch is a ``TransferError``
naming the file at fault, and nothing is installed. Importing a baseline that is already stored
and intact changes nothing (idempotent).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import tarfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from cleanroom.baseline import store
from cleanroom.baseline.spec import SOURCE_DATE_EPOCH
from cleanroom.core.baseline_model import METADATA_FILE, Baseline
from cleanroom.errors import BaselineNotFound, DriftError, TransferError
from cleanroom.host.digests import digest_of
from cleanroom.host.paths import baselines_dir

_CHUNK = 1 << 20
MAX_METADATA = 4 * 1024 * 1024


@dataclass(frozen=True)
class ImportResult:
    baseline: Baseline
    already_present: bool  # the same baseline was already stored and intact


def _tarinfo(name: str, size: int, mode: int = 0o444) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, SOURCE_DATE_EPOCH
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def export_baseline(ref: str, dest: Path) -> Baseline:
    """Write the baseline ``ref`` (digest, prefix or built spec) to ``dest`` as one tar file."""
    baseline = store.resolve(ref)
    store.require_intact(baseline)  # never ship a drifted baseline
    meta = store.metadata(baseline)
    if isinstance(meta.get("built"), dict):
        meta["built"].pop("mtime_ns", None)  # the importing host records its own
    meta_bytes = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
    try:
        with (
            tmp.open("wb") as raw,
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            tar.addfile(_tarinfo(METADATA_FILE, len(meta_bytes), 0o644), io.BytesIO(meta_bytes))
            for component in sorted(baseline.components, key=lambda c: c.name):
                path = baseline.path / component.name
                with path.open("rb") as f:
                    tar.addfile(_tarinfo(component.name, component.size), f)
            tar.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, dest)
    except OSError as exc:
        raise TransferError(f"cannot write {dest}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    # The components must not have changed while they were read.
    store.require_intact(baseline)
    return baseline


def _copy_hashed(src: IO[bytes], dest: Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with dest.open("xb") as out:
        while chunk := src.read(_CHUNK):
            out.write(chunk)
            h.update(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return size, h.hexdigest()


def _unpack(archive: Path, staging: Path) -> tuple[dict[str, Any], dict[str, tuple[int, str]]]:
    """Unpack regular files into ``staging``; the metadata and each file's (size, sha256)."""
    meta: dict[str, Any] | None = None
    seen: dict[str, tuple[int, str]] = {}
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for index, member in enumerate(tar):
                name = member.name
                if index == 0 and name != METADATA_FILE:
                    raise TransferError(f"{archive}: the first entry must be {METADATA_FILE}")
                if not member.isfile() or "/" in name or name in ("", ".", "..") or name in seen:
                    raise TransferError(f"{archive}: unexpected entry {name!r} (not a plain file)")
                src = tar.extractfile(member)
                assert src is not None
                if name == METADATA_FILE:
                    meta = _parse_metadata(archive, src.read(MAX_METADATA + 1))
                    seen[name] = (member.size, "")
                    continue
                allowed = {c.get("name") for c in (meta or {}).get("components", [])}
                if name not in allowed:
                    raise TransferError(f"{archive}: {name!r} is not a component of the baseline")
                seen[name] = _copy_hashed(src, staging / name)
    except (tarfile.TarError, EOFError) as exc:
        raise TransferError(f"{archive}: not a readable baseline archive: {exc}") from exc
    except OSError as exc:
        raise TransferError(f"cannot read {archive}: {exc}") from exc
    if meta is None:
        raise TransferError(f"{archive}: no {METADATA_FILE} in the archive")
    return meta, seen


def _parse_metadata(archive: Path, raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_METADATA:
        raise TransferError(f"{archive}: {METADATA_FILE} is too large")
    try:
        data: dict[str, Any] = json.loads(raw)
    except ValueError as exc:
        raise TransferError(f"{archive}: {METADATA_FILE} is not valid JSON: {exc}") from exc
    components = data.get("components") if isinstance(data, dict) else None
    if not isinstance(components, list) or not all(isinstance(c, dict) for c in components):
        raise TransferError(f"{archive}: {METADATA_FILE} lists no components")
    return data


def _check(archive: Path, staging: Path, meta: dict[str, Any], seen: dict[str, Any]) -> Baseline:
    try:
        baseline = Baseline.from_json(staging, meta)
    except (KeyError, TypeError, ValueError) as exc:
        raise TransferError(f"{archive}: {METADATA_FILE} is not a baseline: {exc}") from exc
    for component in baseline.components:
        if component.name not in seen:
            raise TransferError(f"{archive}: component {component.name} is missing")
        if seen[component.name] != (component.size, component.sha256):
            raise TransferError(
                f"{archive}: {component.name} does not match its sha256 in {METADATA_FILE}; "
                "refusing the import"
            )
    if digest_of(baseline.identity()) != baseline.digest:
        raise TransferError(
            f"{archive}: {METADATA_FILE} does not match its digest {baseline.digest}; "
            "refusing the import"
        )
    return baseline


def import_baseline(archive: Path) -> ImportResult:
    """Verify and install a baseline archive; see the module docstring."""
    archive = Path(archive)
    root = baselines_dir()
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".import-{secrets.token_hex(6)}"
    staging.mkdir(mode=0o755)
    try:
        meta, seen = _unpack(archive, staging)
        baseline = _check(archive, staging, meta, seen)
        with contextlib.suppress(BaselineNotFound, DriftError):
            existing = store.load(baseline.digest)
            if not store.verify(existing):
                return ImportResult(existing, already_present=True)
        for component in baseline.components:
            (staging / component.name).chmod(0o444)
        meta["built"] = {
            **(meta.get("built") or {}),
            "imported": {
                "at": datetime.now(UTC).isoformat(timespec="seconds"),
                "from": str(archive),
            },
            "mtime_ns": {
                c.name: (staging / c.name).stat().st_mtime_ns for c in baseline.components
            },
        }
        (staging / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        final = root / baseline.digest.removeprefix("sha256:")
        if final.exists():  # present but drifted: replace it
            shutil.rmtree(final)
        os.replace(staging, final)
        store.record_spec(
            baseline.spec_digest, baseline.digest, str(meta["built"].get("builder_fingerprint", ""))
        )
        return ImportResult(store.load(baseline.digest), already_present=False)
    except OSError as exc:
        raise TransferError(f"cannot install {archive}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
