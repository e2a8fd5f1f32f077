"""Running the build's external tools (mmdebstrap, apt-get, mkfs.erofs, ...).

One helper, so every failed command becomes the same ``BuildError``: which step, which command,
its exit code and the tail of its stderr. A missing tool is a ``ConfigError``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from cleanroom.errors import BuildError, ConfigError

Progress = Callable[[str, str], None]
"""A build progress callback: ``(step, detail)``, e.g. ``("rootfs", "running mmdebstrap")``."""

STDERR_TAIL = 2000
DEFAULT_TIMEOUT_S = 1800.0
"""The longest any build command may run (mmdebstrap on a slow mirror is the longest)."""


def quiet(step: str, detail: str) -> None:
    """The default progress callback: ignore everything."""


def tail(text: bytes | str, limit: int = STDERR_TAIL) -> str:
    """The last ``limit`` characters of a command's output, decoded leniently."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def require_tool(name: str) -> str:
    """The absolute path of a host tool, or ConfigError naming the package that provides it."""
    found = shutil.which(name)
    if found is None:
        raise ConfigError(
            f"{name} not found on PATH; install the host tools "
            "(qemu-system-x86 mmdebstrap erofs-utils busybox-static lz4 gcc libc6-dev)"
        )
    return found


def run(
    cmd: Sequence[str | Path],
    step: str,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    input_bytes: bytes | None = None,
    ok_codes: tuple[int, ...] = (0,),
    inherit_env: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``cmd``; raise BuildError (with the stderr tail) unless it exits with an ok code
    within ``timeout_s`` (else it is killed: a BuildError saying so).

    ``env`` is added to this process's environment, or replaces it if ``inherit_env`` is false.
    """
    args = [str(a) for a in cmd]
    require_tool(args[0])
    full_env: dict[str, str] | None
    if env is None:
        full_env = None if inherit_env else {}
    else:
        full_env = {**os.environ, **env} if inherit_env else dict(env)
    try:
        proc = subprocess.run(
            args,
            cwd=cwd,
            env=full_env,
            input=input_bytes,
            stdin=None if input_bytes is not None else subprocess.DEVNULL,
            capture_output=True,
            check=False,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise BuildError(f"{step}: {args[0]} timed out after {timeout_s:g} s (killed)") from None
    except OSError as exc:
        raise BuildError(f"{step}: cannot run {args[0]}: {exc}") from exc
    if proc.returncode not in ok_codes:
        detail = tail(proc.stderr) or tail(proc.stdout) or "(no output)"
        raise BuildError(
            f"{step}: {' '.join(args[:4])}{' ...' if len(args) > 4 else ''} "
            f"exited with {proc.returncode}:\n{detail}"
        )
    return proc
