"""``sb.files``: move files between the caller and a session's env, each a transcript step.

    await sb.files.write("/repo/fix.py", b"...");  data = await sb.files.read("/repo/out.txt")
    await sb.files.exists("/repo/x");  names = await sb.files.list("/repo")
    await sb.files.upload_dir(local_dir, "/repo");  await sb.files.download_dir("/repo/out", local)

Every file moved is a step with its path, size and sha256. ``download_dir`` takes the guest's
names through the one boundary (``wire.guest_name``: relative, no ``..``), creates files on the
host with ``O_EXCL | O_NOFOLLOW`` under the caller's folder only, and stops at the episode's
output quota (``QuotaExceeded``): the guest chooses what is in the folder, never where it lands.
"""

from __future__ import annotations

import os
from pathlib import Path

from cleanroom.agent import wire
from cleanroom.errors import QuotaExceeded, SessionPathError
from cleanroom.sessions.guard import Guard
from cleanroom.sessions.transcript import digest

LIST_MAX = 64 * 1024  # names one ``list``/``download_dir`` takes from the guest


class Files:
    """Files of one session (built with its ``Guard`` and the output quota in bytes)."""

    def __init__(self, guard: Guard, quota_bytes: int) -> None:
        self._guard, self._quota = guard, quota_bytes

    async def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write ``data`` (text as UTF-8) to ``path`` in the guest, any size (chunked)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        async with self._guard.call() as env:
            await env.put(path, raw, mode)
        transcript = self._guard.transcript
        transcript.add("put", path=path, mode=mode, **digest(raw), **transcript.content(raw))

    async def read(self, path: str) -> bytes:
        """The bytes of ``path`` in the guest."""
        async with self._guard.call() as env:
            data: bytes = await env.get(path)
        self._guard.transcript.add("get", path=path, **digest(data))
        return data

    async def _sh(self, script: str, *args: str) -> tuple[int | None, bytes]:
        async with self._guard.call() as env:
            r = await env.exec(["/bin/sh", "-c", script, "sh", *args], max_output=LIST_MAX * 4)
        return r.exit_code, r.stdout

    async def exists(self, path: str) -> bool:
        code, _ = await self._sh('test -e "$1"', path)
        return code == 0

    async def list(self, path: str) -> list[str]:
        """The names in the guest folder ``path`` (``SessionPathError`` if it is none)."""
        code, out = await self._sh('cd "$1" && find . -mindepth 1 -maxdepth 1 -print0', path)
        if code != 0:
            raise SessionPathError(f"files.list: {path!r} is not a folder in the guest")
        with self._guard.judged():  # a name the host refuses is the guest's doing
            return sorted(str(_name(n)) for n in out.split(b"\0") if n)

    async def upload_dir(self, local_dir: str | Path, dest: str) -> int:
        """Every file under ``local_dir`` to the same place under ``dest``; how many."""
        root = Path(local_dir)
        if not root.is_dir():
            raise SessionPathError(f"files.upload_dir: {root} is not a folder here")
        count = 0
        for here in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            rel = here.relative_to(root).as_posix()
            await self.write(
                f"{dest.rstrip('/')}/{rel}", here.read_bytes(), here.stat().st_mode & 0o777
            )
            count += 1
        return count

    async def download_dir(self, src: str, local_dir: str | Path) -> int:
        """Every file under the guest folder ``src`` into ``local_dir`` (made if missing; a
        file already there is not overwritten); how many."""
        code, out = await self._sh('cd "$1" && find . -type f -print0', src)
        if code != 0:
            raise SessionPathError(f"files.download_dir: {src!r} is not a folder in the guest")
        root = Path(local_dir)
        root.mkdir(parents=True, exist_ok=True)
        left, count = self._quota, 0
        for raw in sorted(n for n in out.split(b"\0") if n):
            with self._guard.judged():  # a name the host refuses is the guest's doing
                rel = _name(raw)
            data = await self.read(f"{src.rstrip('/')}/{rel}")
            left -= len(data)
            if left < 0:
                with self._guard.judged():  # so is a folder over the output quota
                    raise QuotaExceeded(f"files.download_dir {src!r}: over {self._quota} bytes")
            _create(root, rel.parts, data)
            count += 1
        return count


def _name(raw: bytes) -> Path:
    """A name ``find`` printed in the guest, checked at the boundary (``./`` dropped)."""
    text = raw.decode("utf-8", "surrogateescape").removeprefix("./")
    return Path(wire.guest_name(text, "guest file name"))


def _create(root: Path, parts: tuple[str, ...], data: bytes) -> None:
    """Write ``data`` at ``root/parts``: folders made without following links, the file new."""
    folder = root
    for part in parts[:-1]:
        folder = folder / part
        if folder.is_symlink():
            raise SessionPathError(f"{folder} is a link; not written through")
        try:
            folder.mkdir(exist_ok=True)
        except OSError as exc:
            raise SessionPathError(f"files.download_dir: cannot make {folder}: {exc}") from exc
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(folder / parts[-1], flags, 0o600)
    except OSError as exc:  # there already, a link, a name this filesystem refuses
        raise SessionPathError(
            f"files.download_dir: cannot create {folder / parts[-1]}: {exc}"
        ) from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)
