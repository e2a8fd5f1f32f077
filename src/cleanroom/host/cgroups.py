"""Env identity by cgroup: each env's processes in a cgroup only the controller creates.

A process name is no proof of anything (any local user can ``exec -a cleanroom-env-<id>``); a
cgroup can only be made and joined by root, so the host answers "which processes are this
env?" by the cgroup's ``cgroup.procs``, and "is this env gone?" by the cgroup being empty and
removed. Detection (``detect``, once per process):

  - cgroup v2 (``/sys/fs/cgroup`` on a pure v2 host, ``/sys/fs/cgroup/unified`` on a hybrid
    one such as this machine's) with ``cgroup.kill``: destroy writes ``1`` there, the kernel
    kills every process inside at once;
  - else cgroup v1 ``freezer``: destroy freezes the cgroup (no process can fork meanwhile),
    SIGKILLs every pid in it, thaws it;
  - else none (or ``CLEANROOM_CGROUPS=off``): envs are found by their marker, processes of
    another uid ignored, signals sent through a pidfd; ``jail()`` says so in provenance.

Layout: ``<tree>/cleanroom/<scope>/<env_id>``, ``scope`` naming the driver and its run folder
(two controllers with different homes never list or kill each other's envs). A process joins
its env's cgroup before it execs anything else (``wrap``: a shell writes its own pid into
``cgroup.procs``, then execs the real command), so every descendant is inside from the start.
An env made with ``EnvLimits`` also gets memory and pids limits (``cgroup_limits.py``: in the
env's own v2 cgroup, or in v1 ``memory``/``pids`` cgroups of the same layout that ``wrap``
joins too); ``jail()`` records them and where they were enforced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cleanroom.host import cgroup_limits, hostproc, jail
from cleanroom.host.cgroup_limits import EnvLimits

SYSFS = Path("/sys/fs/cgroup")
TOP = "cleanroom"  # our folder in the tree: <tree>/cleanroom/<scope>/<env_id>
SWITCH_ENV = "CLEANROOM_CGROUPS"  # "off": no cgroups (the marker fallback), else detect
FALLBACK = "marker + uid + pidfd (no usable cgroup on this host)"


@dataclass(frozen=True)
class Tree:
    """A cgroup hierarchy we can create env cgroups in."""

    kind: str  # "v2" (cgroup.kill) or "v1-freezer"
    root: Path  # the hierarchy's mount point


def _v2_tree(root: Path) -> Tree | None:
    top = root / TOP
    try:
        top.mkdir(exist_ok=True)
    except OSError:
        return None
    return Tree("v2", root) if (top / "cgroup.kill").exists() else None


def _v1_freezer(root: Path) -> Tree | None:
    try:
        (root / TOP).mkdir(exist_ok=True)
    except OSError:
        return None
    return Tree("v1-freezer", root) if (root / TOP / "freezer.state").exists() else None


def switched_off() -> bool:
    return os.environ.get(SWITCH_ENV, "").strip().lower() == "off"


@functools.cache
def detect() -> Tree | None:
    """The tree env cgroups go in on this host (None: none usable, or switched off)."""
    if switched_off():
        return None
    if (SYSFS / "cgroup.controllers").exists():  # pure v2
        return _v2_tree(SYSFS)
    if (SYSFS / "unified" / "cgroup.procs").exists():  # hybrid: v2 without controllers
        tree = _v2_tree(SYSFS / "unified")
        if tree is not None:
            return tree
    if (SYSFS / "freezer" / "cgroup.procs").exists():
        return _v1_freezer(SYSFS / "freezer")
    return None


def scope_of(driver: str, run_root: Path) -> str:
    """The folder one driver's envs under one run folder share (``qemu-<12 hex>``)."""
    return f"{driver}-{hashlib.sha256(str(run_root).encode()).hexdigest()[:12]}"


class EnvGroups:
    """The cgroups of one driver's envs (``tree`` None: the marker fallback)."""

    def __init__(self, tree: Tree | None, scope: str) -> None:
        self.tree = tree
        self.base = tree.root / TOP / scope if tree is not None else None
        v2_root = tree.root if tree is not None and tree.kind == "v2" else None
        found = [] if switched_off() else cgroup_limits.hierarchies(v2_root, scope)
        self.limit = cgroup_limits.Limit(found, scope)
        self._limits: dict[str, EnvLimits] = {}  # env_id -> the limits it was made with
        self._joined: dict[str, list[Path]] = {}  # env_id -> v1 limit cgroups it joins

    def path(self, env_id: str) -> Path | None:
        return self.base / env_id if self.base is not None else None

    def jail(self, env_id: str) -> dict[str, Any]:
        """What identifies the env's processes and limits them, for provenance."""
        path = self.path(env_id)
        facts: dict[str, Any] = {"identity": FALLBACK, "cgroup": None}
        if self.tree is not None and path is not None:
            facts = {"identity": "cgroup", "cgroup": str(path), "cgroup_kind": self.tree.kind}
        limits = self._limits.get(env_id)
        if limits is not None:
            facts["limits"] = {"memory_bytes": limits.memory_bytes, "pids": limits.pids}
            facts["enforced"] = self.limit.enforced(limits)
            facts["limit_cgroups"] = [str(p) for p in self._joined.get(env_id, [])]
        return facts

    def create(self, env_id: str, limits: EnvLimits | None = None) -> None:
        """Make the env's (empty) cgroup, with ``limits`` where the host can enforce them;
        OSError if it cannot be made (or a limit cannot be written)."""
        path = self.path(env_id)
        if limits is not None:
            self.limit.prepare()
        if path is not None:
            try:
                path.mkdir(parents=True)
            except FileNotFoundError:  # the scope went with its last env meanwhile: again
                path.mkdir(parents=True)
        if limits is not None:
            self._limits[env_id] = limits
            self._joined[env_id] = self.limit.create(env_id, limits, path)

    def wrap(self, env_id: str, argv: list[str]) -> list[str]:
        """``argv`` run inside the env's cgroup (and its limit cgroups) from its first
        instruction on."""
        path = self.path(env_id)
        procs = [*([path] if path is not None else []), *self._joined.get(env_id, [])]
        if not procs:
            return argv
        n = len(procs)
        join = " && ".join(f'echo $$ > "${i}"' if i else 'echo $$ > "$0"' for i in range(n))
        files = [str(p / "cgroup.procs") for p in procs]
        return ["/bin/sh", "-c", f'{join} && shift {n - 1} && exec "$@"', *files, *argv]

    def pids(self, env_id: str) -> list[int]:
        """The processes in the env's cgroup (fallback: root's with the env's marker)."""
        path = self.path(env_id)
        if path is None:
            return own_pids_with_marker(env_id)
        try:
            text = (path / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        except OSError:  # unreadable: treat as still there
            return [0]
        return [int(line) for line in text.split()]

    def exists(self, env_id: str) -> bool:
        path = self.path(env_id)
        return path.exists() if path is not None else bool(own_pids_with_marker(env_id))

    def kill(self, env_id: str) -> None:
        """SIGKILL every process of the env (v2: ``cgroup.kill``; v1: frozen first)."""
        path = self.path(env_id)
        if self.tree is None or path is None:
            pidfd_kill(own_pids_with_marker(env_id))
            return
        with contextlib.suppress(FileNotFoundError):
            if self.tree.kind == "v2":
                (path / "cgroup.kill").write_text("1")
                return
            (path / "freezer.state").write_text("FROZEN")
            try:
                hostproc.kill_pids(self.pids(env_id), signal.SIGKILL)
            finally:
                (path / "freezer.state").write_text("THAWED")

    async def remove(self, env_id: str, timeout_s: float = 2.0) -> bool:
        """Wait for the cgroup to empty, then remove it; True once it is gone."""
        path = self.path(env_id)
        if path is None:
            return not own_pids_with_marker(env_id) and self.remove_limits(env_id)
        end = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY: a process (or a dying one) is still inside
                if time.monotonic() > end:
                    return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)
        with contextlib.suppress(OSError):  # the scope goes with its last env (EBUSY if not)
            path.parent.rmdir()
        return self.remove_limits(env_id)

    def remove_limits(self, env_id: str) -> bool:
        """Remove the env's v1 limit cgroups (its processes are gone); True once gone."""
        gone = self.limit.remove(env_id)
        if gone:
            self._limits.pop(env_id, None)
            self._joined.pop(env_id, None)
        return gone

    def listed(self) -> set[str]:
        """Env ids that have a cgroup under this scope."""
        if self.base is None or not self.base.is_dir():
            return set()
        return {p.name for p in self.base.iterdir() if p.name.startswith("env-") and p.is_dir()}


def own_pids_with_marker(env_id: str) -> list[int]:
    """Processes with the env's marker that are ours (``jail.ours``: this controller's uid or
    a jail uid; an env of an older version, or the fallback); another user's ``exec -a
    cleanroom-env-<id>`` is not one."""
    return [pid for pid in hostproc.pids_with_marker(env_id) if jail.ours(hostproc.uid_of(pid))]


def pidfd_kill(pids: list[int]) -> None:
    """SIGKILL through a pidfd, and only a process of ours (``jail.ours``): the uid is read
    once the pidfd is open and trusted only if the process is still alive after (so its pid
    was not reused)."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            uid = hostproc.uid_of(pid)
            signal.pidfd_send_signal(fd, 0)  # ESRCH if it died: /proc/<pid> may be another
            if jail.ours(uid):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)
