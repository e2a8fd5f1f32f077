"""Static programs compiled on the host by its ``gcc``, once per digest of their sources.

``cached_binary`` keeps each one in ``cache_dir()/<folder>/<key>/<name>``, where ``key``
(``source_key``) hashes the sources' bytes and the flags: an edited source is rebuilt, an
unchanged one never. Files the program expects beside it (``extras``) are copied into the same
folder. It is filled privately and renamed into place, so two processes building at once both
end with a whole one. No ``gcc`` on the host, or a
compile that fails, is the caller's typed error, naming what needed it.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from cleanroom.errors import CleanroomError
from cleanroom.host.paths import cache_dir


def source_key(sources: Iterable[Path], flags: Sequence[str]) -> str:
    """16 hex digits of sha256 over each source's name and bytes, then the flags."""
    h = hashlib.sha256()
    for path in sources:
        body = path.read_bytes()
        h.update(f"{path.name}\0{len(body)}\0".encode())
        h.update(body)
    h.update("\0".join(flags).encode())
    return h.hexdigest()[:16]


def cached_binary(
    folder: str,
    name: str,
    key: str,
    argv: Callable[[str, Path], list[str]],
    *,
    cwd: Path,
    error: type[CleanroomError],
    needed_by: str,
    extras: Sequence[Path] = (),
) -> Path:
    """The binary ``name`` of sources ``key``, compiled here on first use.

    ``argv(gcc, output)`` is the compiler command (run in ``cwd``); ``needed_by`` says, in the
    error, what wanted it (``"the fake driver's guest agent"``)."""
    home = cache_dir() / folder / key
    if (home / name).is_file():
        return home / name
    gcc = shutil.which("gcc")
    if gcc is None:
        raise error(f"{needed_by} is compiled on the host: it needs gcc (make setup installs it)")
    home.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=home.parent))
    try:
        proc = subprocess.run(argv(gcc, partial / name), cwd=cwd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise error(f"{needed_by}: cannot compile {name}: {proc.stderr.strip()[-400:]}")
        for extra in extras:
            shutil.copyfile(extra, partial / extra.name)
        partial.chmod(0o755)
        with contextlib.suppress(FileExistsError, OSError):  # another process won the race
            partial.rename(home)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if not (home / name).is_file():
        raise error(f"{needed_by}: {home / name} is not there after building it")
    return home / name
