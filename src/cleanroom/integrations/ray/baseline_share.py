"""The run's baseline through the run's store: for a node that can neither find nor build it.

The driver exports the baseline once per store (``baseline export``'s archive, content-addressed
as ``<store>/baselines/<sha256>.tar``; an archive already there is kept) only when a node says
it cannot get the baseline; such a node then fetches the archive and imports it
(``baseline import``: every component's sha256 and the digest are re-checked, nothing installed
on a mismatch) before its first episode.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path

from cleanroom.baseline.transfer import export_baseline, import_baseline
from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import BaselineError, TransferError
from cleanroom.host.paths import baselines_dir
from cleanroom.store import FsspecStore, LocalStore, Store

FOLDER = "baselines"


def archive_url(store: Store, digest: str) -> str:
    """Where ``digest``'s archive lives in ``store`` (a path for a folder store, else a URL)."""
    name = f"{FOLDER}/{digest.removeprefix('sha256:')}.tar"
    if isinstance(store, LocalStore):
        return str(store.root / name)
    assert isinstance(store, FsspecStore)
    return f"{store.url.rstrip('/')}/{name}"


def publish(store: Store, baseline: Baseline) -> str:
    """Put ``baseline``'s archive in ``store`` unless it is there; its URL."""
    url = archive_url(store, baseline.digest)
    if isinstance(store, LocalStore):
        dest = Path(url)
        if not dest.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
            try:
                export_baseline(baseline.digest, part)
                os.replace(part, dest)
            finally:
                with contextlib.suppress(OSError):
                    part.unlink()
        return url
    assert isinstance(store, FsspecStore)
    if store.fs.exists(url):
        return url
    with tempfile.TemporaryDirectory(prefix="cleanroom-share-") as tmp:
        local = Path(tmp) / "baseline.tar"
        export_baseline(baseline.digest, local)
        try:
            store.fs.put_file(str(local), url)
        except Exception as exc:
            raise TransferError(f"cannot put the baseline archive at {url}: {exc}") from exc
    return url


def fetch(store: Store, url: str, digest: str) -> Baseline:
    """Import the archive at ``url`` (in the run's ``store``) on this node; it must be
    ``digest``."""
    root = baselines_dir()
    root.mkdir(parents=True, exist_ok=True)
    if isinstance(store, LocalStore):
        result = import_baseline(Path(url))
    else:
        assert isinstance(store, FsspecStore)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as tmp:
            local = Path(tmp) / "baseline.tar"
            try:
                store.fs.get_file(url, str(local))
            except Exception as exc:
                raise TransferError(f"cannot fetch the baseline archive {url}: {exc}") from exc
            result = import_baseline(local)
    if result.baseline.digest != digest:
        raise BaselineError(f"{url} holds baseline {result.baseline.digest}, not {digest}")
    return result.baseline
