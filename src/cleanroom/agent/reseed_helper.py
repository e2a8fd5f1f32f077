"""The agent's side of the native reseed helper (``reseed.c``, built into every baseline).

At SNAPSHOT_PREPARE the agent starts the helper and lets it hold the control port: in a clone
it answers RESEED with HELLO in a few hundred translated blocks instead of the interpreter's
thousands, then hands the agent what it read (``outcome``). Without the helper (not built: the
agent outside a baseline) the agent answers RESEED itself, and its OK to SNAPSHOT_PREPARE says
why.
"""

from __future__ import annotations

import os
import subprocess

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reseed")
READY_S = 10.0


class ReseedHelper:
    """A started helper: its process and the read end of its pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], pipe: int) -> None:
        self.proc = proc
        self.pipe = pipe

    @classmethod
    def start(
        cls, port: Any, pool: Any, hello_prefix: str, helper: str | None = None
    ) -> ReseedHelper:
        """Start the helper (default ``HELPER``) on ``port`` (the control stream) and ``pool``
        (``/dev/urandom``, writable). OSError if there is none or it did not get ready (the
        agent then reseeds clones itself)."""
        read_end, write_end = os.pipe()
        fds = (port.fileno(), write_end, pool.fileno())
        try:
            proc = subprocess.Popen(
                [helper or HELPER, *map(str, fds), hello_prefix],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
            )
        except OSError:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        ready = _read_all(read_end, limit=1, timeout_s=READY_S)
        if ready != b"R":
            proc.kill()
            code = proc.wait()
            os.close(read_end)
            raise OSError(f"the reseed helper did not get ready (exit code {code})")
        return cls(proc, read_end)

    def outcome(self) -> tuple[bytes, bytes]:
        """Block until the helper has read the clone's first frame: ``(b"H", the RESEED it
        answered)`` or ``(b"P", the bytes it consumed of a frame it left to the agent)``."""
        try:
            data = _read_all(self.pipe)
        finally:
            os.close(self.pipe)
            self.proc.wait()
        return (data[:1], data[1:]) if data[:1] == b"H" else (b"P", data[1:])


def _read_all(fd: int, limit: int | None = None, timeout_s: float | None = None) -> bytes:
    """Read ``fd`` to its end (or ``limit`` bytes); b"" if nothing came within ``timeout_s``."""
    import select

    chunks: list[bytes] = []
    size = 0
    while limit is None or size < limit:
        if timeout_s is not None and not select.select([fd], [], [], timeout_s)[0]:
            break
        chunk = os.read(fd, 65536 if limit is None else limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class Prefixed:
    """A byte stream that yields ``data`` first, then reads ``stream`` (``read`` only)."""

    def __init__(self, data: bytes, stream: Any) -> None:
        self.data = data
        self.stream = stream

    def read(self, size: int) -> bytes:
        if self.data:
            chunk, self.data = self.data[:size], self.data[size:]
            return chunk
        return bytes(self.stream.read(size))
