"""Is a process that owns something (an env, a snapshot, a run's lock) still alive?

An owner is named by host, pid and the time it took what it owns: a pid that is gone, or that
a later process reused (it started after that time), is a dead owner. Owners on other hosts
cannot be checked from here and count as alive.
"""

from __future__ import annotations

import os
import socket

from cleanroom.host import hostproc


def _start_time(pid: int) -> float | None:
    """Unix time at which ``pid`` started, or None if it is not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def owner_alive(host: str | None, pid: int | None, since: float | None) -> bool:
    """Is the owning controller still running? (Other hosts' owners are assumed alive.)"""
    if host is not None and host != socket.gethostname():
        return True
    if pid is None or not hostproc.pid_alive(pid):
        return False
    started = _start_time(pid)
    return started is None or since is None or started <= since + 1.0
