"""A served sandbox's resource use, for E2B's ``GET /sandboxes/{id}/metrics``.

Measured on the host, never asked of the guest: the env's processes are its cgroup's
(``Driver.env_pids``: the QEMU or runsc process and its helpers); their CPU time and RSS come
from ``/proc``, the disk used is what its run folder holds on the host (the copy-on-write
overlay). Each request takes one sample and keeps it (``KEEP`` per sandbox); CPU use is the
share of the sandbox's vCPUs used since its previous sample (since the env started, for the
first). ``memTotal`` is the env's memory limit, ``diskTotal`` what it holds plus the free space
of the filesystem under its run folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.drivers.base import Driver, RunFolderDriver

KEEP = 720  # samples per sandbox: an hour of one every 5 s
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_s(pid: int) -> float:
    """CPU time of one process and of the children it waited for, in seconds (0 once it is
    gone): a command that ended counts in the agent that reaped it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(f) for f in fields[11:15]) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def allocated(folder: Path, most: int = 10_000) -> int:
    """Bytes the files under ``folder`` occupy on disk (sparse files by their blocks)."""
    total = 0
    for i, (root, _, files) in enumerate(os.walk(folder)):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
        if i > most:
            break
    return total


@dataclass
class Usage:
    """The samples kept for each sandbox (by sandbox id), and how to take one."""

    driver: Driver
    kept: dict[str, deque[dict[str, Any]]] = field(default_factory=dict)
    last: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (t, cpu_s)

    def sample(self, sandbox_id: str, env_id: str, vcpus: int, memory_mib: int) -> None:
        """One sample of the env now, kept under ``sandbox_id``."""
        pids = self.driver.env_pids(env_id)
        now, used = time.time(), sum(cpu_s(p) for p in pids)
        since, before = self.last.get(sandbox_id, (_started(pids, now), 0.0))
        pct = 100.0 * max(0.0, used - before) / max(1e-3, now - since) / max(1, vcpus)
        self.last[sandbox_id] = (now, used)
        disk_used, disk_free = 0, 0
        if isinstance(self.driver, RunFolderDriver):
            run_dir = self.driver.run_dir(env_id)
            if run_dir.is_dir():
                disk_used = allocated(run_dir)
                disk_free = shutil.disk_usage(run_dir).free
        self.kept.setdefault(sandbox_id, deque(maxlen=KEEP)).append(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "timestampUnix": int(now),
                "cpuCount": vcpus,
                "cpuUsedPct": round(min(100.0, pct), 2),
                "memUsed": sum(rss_bytes(p) for p in pids),
                "memTotal": memory_mib * 1024 * 1024,
                "memCache": 0,
                "diskUsed": disk_used,
                "diskTotal": disk_used + disk_free,
            }
        )

    def samples(self, sandbox_id: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """The kept samples with ``start <= timestampUnix <= end``."""
        return [
            s
            for s in self.kept.get(sandbox_id, ())
            if (start is None or s["timestampUnix"] >= start)
            and (end is None or s["timestampUnix"] <= end)
        ]

    def forget(self, alive: set[str]) -> None:
        """Drop what is kept of sandboxes not in ``alive``."""
        for sid in set(self.kept) - alive:
            self.kept.pop(sid, None)
            self.last.pop(sid, None)


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _started(pids: list[int], now: float) -> float:
    """When the oldest of ``pids`` started (epoch seconds); ``now`` if none is readable."""
    boot = _boot_time()
    if boot is None:
        return now
    starts = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            starts.append(boot + int(fields[19]) / TICK)
        except (OSError, IndexError, ValueError):
            continue
    return min(starts, default=now)
