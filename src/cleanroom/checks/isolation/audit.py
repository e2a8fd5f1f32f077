"""The host-side audit that ends ``cleanroom check isolation``.

After the variants, it looks at the host itself for anything left of the check's envs: an env
the driver still finds (process or run folder), processes whose command line carries an env
marker or a canary token, unix sockets naming an env, and files naming a token under the
driver's run folders, the staging folder and each env's guest root on the host (drivers without
a VM). Each finding is a ``Leftover`` and makes the check fail; processes and envs found are
then removed (through a pidfd / ``driver.destroy``), so a failed check leaves the host clean too.

Only processes that are ours count (``ours``: running as the controller's uid or a jail uid, or
inside a cleanroom cgroup, which only root can put a process in): another user's process that
merely carries an env's marker or a token in its command line is neither counted nor signalled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cleanroom.drivers.base import Driver
from cleanroom.host import cgroups, hostproc, jail, paths
from cleanroom.lifecycle.verify import guest_prefix

MAX_WALK = 200_000  # entries looked at per root, at most


@dataclass(frozen=True)
class Leftover:
    kind: str  # "env", "process", "socket", "file"
    what: str
    action: str = ""  # what the audit did about it


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def in_our_cgroup(pid: int) -> bool:
    """Is the process in a cleanroom cgroup (``<tree>/cleanroom/...``, any hierarchy)?"""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    return any(line.split(":", 2)[-1].startswith(f"/{cgroups.TOP}/") for line in lines)


def ours(pid: int) -> bool:
    """A process this host's cleanroom made (module docstring), not another user's."""
    return jail.ours(hostproc.uid_of(pid)) or in_our_cgroup(pid)


def token_processes(tokens: list[str]) -> list[int]:
    """Host processes of ours (not this one) whose command line names one of ``tokens``."""
    needles = [t.encode() for t in tokens]
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        pid = int(entry.name)
        if any(n in cmd for n in needles) and hostproc.pid_alive(pid) and ours(pid):
            found.append(pid)
    return found


def unix_sockets(needles: list[str]) -> list[str]:
    """Paths of bound unix sockets that name one of ``needles``."""
    try:
        lines = Path("/proc/net/unix").read_text(errors="replace").splitlines()[1:]
    except OSError:
        return []
    return sorted({line.split()[-1] for line in lines if any(n in line for n in needles)})


def token_files(roots: list[Path], tokens: list[str]) -> list[str]:
    """Files or folders under ``roots`` whose name contains a token (bounded walk)."""
    found: list[str] = []
    for root in roots:
        seen = 0
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            for name in dirnames + filenames:
                seen += 1
                if any(t in name for t in tokens):
                    found.append(os.path.join(dirpath, name))
            if seen > MAX_WALK:
                break
    return sorted(set(found))


async def audit(driver: Driver, env_ids: list[str], tokens: list[str]) -> list[Leftover]:
    """Everything of the check left on the host; removes what it can (see module docstring)."""
    leftovers: list[Leftover] = []
    for env_id in env_ids:
        pids = [pid for pid in hostproc.pids_with_marker(env_id) if ours(pid)]
        for pid in pids:
            leftovers.append(Leftover("process", f"pid {pid}: {_cmdline(pid)}", "killed"))
        cgroups.pidfd_kill(pids)
        if driver.exists(env_id):
            report = await driver.destroy(env_id)
            action = "destroyed" if report.confirmed_absent else "could not be destroyed"
            leftovers.append(Leftover("env", f"{env_id} still present on the host", action))
    for pid in (found := token_processes(tokens)):
        leftovers.append(Leftover("process", f"pid {pid}: {_cmdline(pid)}", "killed"))
    cgroups.pidfd_kill(found)
    for path in unix_sockets(env_ids):
        leftovers.append(Leftover("socket", path))
    roots = [paths.home() / "staging"]
    run_root = getattr(driver, "run_root", None)
    if isinstance(run_root, Path):
        roots.append(run_root)
    for env_id in env_ids:
        prefix = guest_prefix(driver, env_id)
        if prefix and Path(prefix).exists():
            roots.append(Path(prefix))
    existing = sorted({r for r in roots if r.is_dir()})
    leftovers.extend(Leftover("file", path) for path in token_files(existing, tokens))
    return leftovers
