"""``LocalStore``: a folder on this host; every write fsynced, renamed, read back and re-hashed."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
from pathlib import Path

from cleanroom.errors import ExportError, StoreError
from cleanroom.store.base import RECORD, BaseStore, chunks, digest, export_error, one_part


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: Path) -> None:
    """mkdir -p, fsyncing the parent of every folder it creates."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        _fsync_dir(folder.parent)


_NO_HARDLINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


class LocalStore(BaseStore[Path]):
    """A folder on this host (the default: ``paths.store_dir()``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()

    def _dest(self, run_id: str, episode_id: str, rel: str) -> Path:
        return self.root / "runs" / run_id / "episodes" / episode_id / rel

    def _run_dest(self, run_id: str, rel: str) -> Path:
        return self.root / "runs" / run_id / rel

    def episode_uri(self, run_id: str, episode_id: str) -> str:
        return self._where(run_id, episode_id, RECORD).parent.as_uri()

    def run_uri(self, run_id: str) -> str:
        return (self.root / "runs" / one_part(run_id, "run_id")).as_uri()

    def _exists(self, dest: Path) -> bool:
        return dest.exists()

    def _read(self, dest: Path) -> bytes | None:
        try:
            return dest.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {dest}: {exc}") from exc

    def _episode_ids(self, run_id: str) -> list[str]:
        base = self.root / "runs" / run_id / "episodes"
        try:
            return [p.name for p in base.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"cannot list {base}: {exc}") from exc

    def _put(self, dest: Path, source: bytes | Path, *, exclusive: bool) -> tuple[int, str] | None:
        tmp = dest.parent / f".{dest.name[:100]}.{secrets.token_hex(6)}.tmp"
        placed = False
        try:
            _makedirs(dest.parent)
            h, size = hashlib.sha256(), 0
            with tmp.open("xb") as f:
                for chunk in [source] if isinstance(source, bytes) else chunks(source):
                    f.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                if not _link_new(tmp, dest):
                    return None
            else:
                os.replace(tmp, dest)
            placed = True
            _fsync_dir(dest.parent)
            seen = digest(chunks(dest))
        except OSError as exc:
            if placed:
                dest.unlink(missing_ok=True)
            raise export_error(exc, dest) from exc
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        if seen != (size, h.hexdigest()):
            with contextlib.suppress(OSError):
                dest.unlink()
            raise ExportError(f"{dest}: read back {seen}, wrote {(size, h.hexdigest())}; removed")
        return seen


def _link_new(tmp: Path, dest: Path) -> bool:
    """Place ``tmp`` at ``dest`` only if ``dest`` does not exist (atomically where possible)."""
    try:
        os.link(tmp, dest)
    except FileExistsError:
        return False
    except OSError as exc:  # a filesystem without hard links: check, then rename
        if exc.errno not in _NO_HARDLINKS:
            raise
        if dest.exists():
            return False
        os.replace(tmp, dest)
    return True
