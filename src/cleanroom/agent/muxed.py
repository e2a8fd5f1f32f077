"""The guest's multiplexed requests: each has the host's ``id`` and runs in a worker thread.

``REQUESTS`` maps a frame kind to its handler ``(agent, request, header)``; another module adds
its own with ``register``. Frames for a running request (STDIN, KILL, RESIZE, DATA, ACK) are
``Request.deliver``-ed by the agent's reader thread, which never blocks on them: input waits
in the request's inbox for its thread (stdin has a writer thread of its own, so a process that
does not read cannot stall the agent). Every stream keeps to ``WINDOW`` bytes beyond the
receiver's last ACK. Standard library only, like the rest of the agent.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

if __package__:  # on the host, as part of the package
    from cleanroom.agent.handlers import Failed, set_window
    from cleanroom.agent.protocol import CHUNK, WINDOW, Kind
else:  # in the guest, next to protocol.py
    from handlers import Failed, set_window  # type: ignore[no-redef,import-not-found]
    from protocol import CHUNK, WINDOW, Kind  # type: ignore[no-redef,import-not-found]

ROUTED = frozenset({Kind.STDIN, Kind.KILL, Kind.RESIZE, Kind.DATA, Kind.ACK})
ERRNO_CODES = {2: "not_found", 13: "permission", 20: "not_found", 21: "is_a_directory"}


class Request:
    """One multiplexed request: its frames out (``send`` adds the id), its inbox in."""

    def __init__(self, agent: Any, rid: int) -> None:
        self.agent = agent
        self.rid = rid
        self.cond = threading.Condition()
        self.inbox: collections.deque[Any] = collections.deque()  # bytes; None = end of input
        self.acked = 0  # bytes of a download the host consumed
        self.killed = False
        self.proc: Any = None
        self.pty: int | None = None
        self.stdin: int | None = None

    def send(self, kind: int, header: dict[str, Any] | None = None, body: bytes = b"") -> None:
        self.agent.send(kind, {**(header or {}), "id": self.rid}, body)

    # -- from the reader thread -----------------------------------------------------------------

    def deliver(self, frame: Any) -> None:
        header = frame.header
        with self.cond:
            if frame.kind == Kind.KILL:
                self.killed = True
                if self.proc is not None:
                    with contextlib.suppress(OSError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
            elif frame.kind == Kind.RESIZE:
                if self.pty is not None:
                    with contextlib.suppress(OSError, ValueError, TypeError):
                        set_window(self.pty, (header.get("rows"), header.get("cols")))
            elif frame.kind == Kind.ACK:
                size = header.get("size")
                if isinstance(size, int):
                    self.acked = max(self.acked, size)
            else:  # STDIN, DATA
                if frame.body:
                    self.inbox.append(frame.body)
                if header.get("eof"):
                    self.inbox.append(None)
            self.cond.notify_all()

    # -- in the request's threads ---------------------------------------------------------------

    def next_input(self) -> bytes | None:
        """The next chunk of input; None at its end, or once the request is killed or done."""
        with self.cond:
            while not self.inbox and not self.killed:
                self.cond.wait()
            return None if self.killed else self.inbox.popleft()

    def wait_window(self, sent: int, size: int) -> bool:
        """Block until ``size`` more bytes fit the host's window; False if killed meanwhile."""
        with self.cond:
            while not self.killed and sent - self.acked + size > WINDOW and sent != self.acked:
                self.cond.wait()
            return not self.killed

    def attach(self, proc: Any, stdin: int | None, pty: int | None = None) -> None:
        """The process runs: KILL reaches its group; a writer thread feeds its stdin."""
        with self.cond:
            self.proc, self.pty, self.stdin = proc, pty, stdin
            if self.killed:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if stdin is not None:
            threading.Thread(target=self._feed, args=(stdin, pty is not None), daemon=True).start()

    def detach(self) -> None:
        """The process ended: its stdin writer stops."""
        with self.cond:
            self.killed = True
            self.cond.notify_all()

    def _feed(self, fd: int, terminal: bool) -> None:
        written = 0
        try:
            while True:
                data = self.next_input()
                if data is None:
                    if terminal and not self.killed:
                        with contextlib.suppress(OSError):
                            os.write(fd, b"\x04")  # end of input on a terminal: ^D
                    return
                with contextlib.suppress(OSError):  # a process that closed its stdin
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                if terminal and b"\x03" in data:
                    self._interrupt_unattached(fd)
                written += len(data)
                self.send(Kind.ACK, {"size": written})
        finally:
            os.close(fd)

    def _interrupt_unattached(self, fd: int) -> None:
        """^C on a terminal whose line discipline signals nobody (gVisor keeps no controlling
        terminal for the command): SIGINT to its group, as ISIG would have sent it."""
        import termios

        try:
            if not termios.tcgetattr(fd)[3] & termios.ISIG:
                return  # the program reads ^C as a key (raw mode)
            if os.tcgetpgrp(fd) > 0:
                return  # the kernel delivered it
        except OSError:
            pass
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGINT)


def failed(req: Request, exc: BaseException) -> None:
    """Tell the host why the request failed (FAILED with a code it maps to a typed error)."""
    if isinstance(exc, Failed):
        code = exc.code
    elif isinstance(exc, OSError):
        code = ERRNO_CODES.get(exc.errno or 0, "os_error")
    else:
        code = "error"
    req.send(Kind.FAILED, {"code": code, "message": f"{type(exc).__name__}: {exc}"})


def exec_request(agent: Any, req: Request, header: dict[str, Any]) -> None:
    agent.run_process(header, req)
    req.send(Kind.DONE)


def upload(agent: Any, req: Request, header: dict[str, Any]) -> None:
    """DATA frames into a file (or, with ``tar``, unpacked into a folder); DONE with the size."""
    path = header["path"]
    if header.get("tar"):
        stream = InboxReader(req)
        tarsafe_module().extract(stream, path)
        while stream.read(CHUNK):  # whatever follows the archive's end
            pass
        req.send(Kind.DONE, {"size": stream.size})
        return
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, int(header.get("mode", 0o644)))
    size = 0
    try:
        while (data := req.next_input()) is not None:
            os.write(fd, data)
            size += len(data)
            req.send(Kind.ACK, {"size": size})
    finally:
        os.close(fd)
    req.send(Kind.DONE, {"size": size, "stopped": req.killed})


def download(agent: Any, req: Request, header: dict[str, Any]) -> None:
    """A file (or, with ``tar``, a folder packed as tar) as DATA frames; then DONE."""
    sink = DataWriter(req)
    if header.get("tar"):
        tarsafe = tarsafe_module()
        with contextlib.suppress(tarsafe.Stopped):
            tarsafe.pack(header["path"], sink)
    else:
        with open(header["path"], "rb") as f:
            while chunk := f.read(CHUNK):
                if not sink.write(chunk):
                    break
    sink.finish()


class InboxReader:
    """The request's DATA as a file to ``read`` (for tarfile), ACKing what it consumed."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.buffer = bytearray()  # deleting from its front moves no bytes
        self.size = 0
        self.ended = False

    def read(self, size: int = -1) -> bytes:
        while not self.ended and (size < 0 or len(self.buffer) < size):
            data = self.req.next_input()
            if data is None:
                self.ended = True
                break
            self.buffer += data
            self.size += len(data)
            self.req.send(Kind.ACK, {"size": self.size})
        if size < 0:
            size = len(self.buffer)
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        return out


class DataWriter:
    """Bytes out as DATA frames of ``CHUNK``, within the host's window (for tarfile too)."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.sent = 0
        self.pending = bytearray()

    def write(self, data: bytes) -> bool:
        self.pending += data
        while len(self.pending) >= CHUNK:
            if not self._flush(CHUNK):
                return False
        return True

    def _flush(self, size: int) -> bool:
        chunk = bytes(self.pending[:size])
        if not self.req.wait_window(self.sent, len(chunk)):
            return False
        del self.pending[:size]
        self.req.send(Kind.DATA, {"offset": self.sent, "eof": False}, chunk)
        self.sent += len(chunk)
        return True

    def finish(self) -> None:
        if self.pending and not self._flush(len(self.pending)):
            self.req.send(Kind.DONE, {"size": self.sent, "stopped": True})
            return
        self.req.send(Kind.DONE, {"size": self.sent})


def tarsafe_module() -> Any:
    """``tarsafe.py``, imported on first use (tarfile costs a guest ~0.1 s under TCG)."""
    if __package__:
        from cleanroom.agent import tarsafe
    else:
        import tarsafe  # type: ignore[import-not-found,no-redef]
    return tarsafe


REQUESTS: dict[int, Callable[[Any, Request, dict[str, Any]], None]] = {
    Kind.EXEC: exec_request,
    Kind.UPLOAD: upload,
    Kind.DOWNLOAD: download,
}


def register(kind: int, handler: Callable[[Any, Request, dict[str, Any]], None]) -> None:
    """Serve frames of ``kind`` (with an id) by ``handler`` (``protocol.register_kind`` first)."""
    REQUESTS[kind] = handler
