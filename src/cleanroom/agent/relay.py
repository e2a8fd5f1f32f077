"""Relays an episode process's stdout and stderr to the host as frames, from the calling thread.

No thread per pipe: in a fresh snapshot clone under TCG every new code path is translated
anew, and starting two threads per episode cost the agent ~10% of a trivial episode. One
``poll`` loop reads whichever pipe has data (``CHUNK`` at most, so frames stay small) and can
watch one more descriptor for the caller (the warm worker's channel).
"""

from __future__ import annotations

import os
import select
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

CHUNK = 64 * 1024
DRAIN_S = 2.0  # after the process ended: how long a grandchild may keep a pipe open
EXIT_POLL_S = 0.1  # without a pidfd (gVisor may lack one): how often to look for the exit


class Relay:
    """Read ends of pipes (fd -> frame kind), forwarded with ``send(kind, {}, data)``."""

    def __init__(self, send: Callable[..., None], pipes: dict[int, int]) -> None:
        self.send = send
        self.pipes = dict(pipes)
        self.poller = select.poll()
        for fd in self.pipes:
            self.poller.register(fd, select.POLLIN)

    def step(self, timeout_s: float | None, watch: tuple[int, ...] = ()) -> set[int]:
        """Forward what the pipes have, waiting up to ``timeout_s`` (None: until something
        happens); returns which of ``watch`` are readable. A pipe at end of file is closed."""
        for fd in watch:
            self.poller.register(fd, select.POLLIN)
        try:
            ready = self.poller.poll(None if timeout_s is None else max(timeout_s, 0) * 1000)
        finally:
            for fd in watch:
                self.poller.unregister(fd)
        watched = set()
        for fd, _ in ready:
            if fd in watch:
                watched.add(fd)
            elif fd in self.pipes:
                try:
                    data = os.read(fd, CHUNK)
                except OSError:  # a PTY's master once no process holds the terminal (EIO)
                    data = b""
                if data:
                    self.send(self.pipes[fd], {}, data)
                else:
                    self._close(fd)
        return watched

    def until_exit(self, proc: Any, deadline: float | None) -> bool:
        """Forward until ``proc`` (a ``subprocess.Popen``) exited (True) or ``deadline``
        (monotonic) passed. Its exit, not its pipes: a grandchild may hold them open."""
        try:
            exited: int | None = os.pidfd_open(proc.pid)  # readable once it exits
        except (OSError, AttributeError):
            exited = None
        try:
            while proc.poll() is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                if exited is None:
                    remaining = EXIT_POLL_S if remaining is None else min(remaining, EXIT_POLL_S)
                self.step(remaining, watch=() if exited is None else (exited,))
            return True
        finally:
            if exited is not None:
                os.close(exited)

    def until_closed(self, deadline: float | None) -> bool:
        """Forward until every pipe is closed (True) or ``deadline`` (monotonic) passed."""
        while self.pipes:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.step(remaining)
        return True

    def drain(self, timeout_s: float | None = None) -> None:
        """After the process ended: what is left in the pipes, then close them all (a
        grandchild still holding one loses it after ``timeout_s``, default ``DRAIN_S``)."""
        self.until_closed(time.monotonic() + (DRAIN_S if timeout_s is None else timeout_s))
        for fd in list(self.pipes):
            self._close(fd)

    def _close(self, fd: int) -> None:
        self.poller.unregister(fd)
        del self.pipes[fd]
        os.close(fd)
