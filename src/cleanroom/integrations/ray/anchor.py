"""A node controller dies with its node: the raylet that started its worker is its anchor.

Ray starts an actor's worker process from the node's raylet. When that raylet dies (the node
is gone), Ray's worker lingers a moment before it exits, and a controller still running then
went on working: it started a spare after its raylet had died (issue 36). ``hold`` makes the
kernel SIGKILL this process the instant its raylet dies (``PR_SET_PDEATHSIG``; every VM's
supervisor chain then gets its own parent-death signal, see ``hostproc.supervised``), and
``gone`` answers "is my node gone?" for the checks before anything new is started.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

from cleanroom.errors import ConfigError

PR_SET_PDEATHSIG = 1
RAYLET = "raylet"  # the process name of a node's raylet (``/proc/<pid>/comm``)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Anchor:
    """This process's raylet (``pid`` None: not started by one, e.g. a test driving a
    ``NodeController`` directly): ``hold`` ties this process's life to it."""

    def __init__(self) -> None:
        parent = os.getppid()
        self.pid = parent if _comm(parent) == RAYLET else None

    def hold(self) -> None:
        """SIGKILL this process when its raylet dies (ConfigError if it died already)."""
        if self.pid is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise ConfigError(
                f"cannot tie this node controller to its raylet: errno {ctypes.get_errno()}"
            )
        if self.gone():  # it died before the signal was set: it will never come
            raise ConfigError(f"this node's raylet (pid {self.pid}) is gone")

    def gone(self) -> bool:
        """True once this process's raylet died (its parent is no longer that raylet)."""
        return self.pid is not None and os.getppid() != self.pid
