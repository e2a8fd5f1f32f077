"""The jail of one qemu env: its own uid, an empty root, its cgroup's limits, and what
provenance says about them.

``Jail.open`` (at spawn, before the process): a uid from ``drivers.jail`` (its lock fd goes to
the process tree, so the uid stays taken while QEMU lives), the chroot folder ``<run_dir>/root``
(empty, 0700, root's: the jailed QEMU can neither list nor write it), and ``limits``: the manifest's
memory plus the VMM's own (``VMM_OVERHEAD_MIB``), and ``PIDS_PER_ENV`` tasks (QEMU's threads:
main, RCU, one per vCPU, its I/O thread pool of up to 64; egress helpers). Where the host has
no jail (not root, or switched off) QEMU runs as the controller's user with every other layer,
and ``facts`` says why. So does an egress VM (``EGRESS``): its slirp runs a helper per guest
connection, the host's Python with ``network/fdpass.py``, which must read the controller's
files and pass the egress proxy's peer-uid check; it keeps its limits and seccomp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cleanroom.drivers.base import EnvRequest
from cleanroom.drivers.qemu.cmdline import JailArgs, sandbox
from cleanroom.host import jail as uids
from cleanroom.host.cgroup_limits import EnvLimits
from cleanroom.host.hostproc import JAIL_BOUNDING_SET

MIB = 1024 * 1024
VMM_OVERHEAD_MIB = 384  # QEMU's own memory beside the guest's (TCG's code cache, devices)
PIDS_PER_ENV = 128  # QEMU's threads (its thread pool alone may reach 64), helpers, wrappers
ROOT_DIR = "root"  # the chroot folder inside the run folder
EGRESS = "egress: slirp's helper runs the host's Python as the controller's user"


def env_limits(request: EnvRequest) -> EnvLimits:
    """The cgroup limits of one env: its manifest's memory and vCPUs plus the VMM's share."""
    lim = request.limits
    return EnvLimits(
        memory_bytes=(lim.memory_mib + VMM_OVERHEAD_MIB) * MIB,
        pids=PIDS_PER_ENV + lim.vcpus,
    )


@dataclass(frozen=True)
class Jail:
    """One env's jail as spawned (``lease`` None: no jail on this host, ``why``)."""

    lease: uids.Lease | None
    args: JailArgs | None
    why: str | None

    @classmethod
    def open(cls, request: EnvRequest, run_dir: Path) -> Jail:
        """Take a uid and make the empty root (ConfigError if no uid is free)."""
        why = uids.unavailable() or (EGRESS if request.network is not None else None)
        if why is not None:
            return cls(None, None, why)
        chroot = run_dir / ROOT_DIR
        chroot.mkdir(mode=0o700)
        lease = uids.allocate()
        return cls(lease, JailArgs(lease.uid, lease.gid, chroot), None)

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.lease.fd,) if self.lease is not None else ()

    def spawned(self) -> None:
        """The process holds the uid's lock now: drop this process's copy."""
        if self.lease is not None:
            self.lease.close()

    def facts(self, request: EnvRequest) -> dict[str, Any]:
        """Who the VMM runs as and what confines it, for provenance."""
        if self.args is None:
            user = f"uid {os.geteuid()} (no jail: {self.why})"
            return {"user": user, "seccomp": sandbox(request, False)}
        return {
            "user": f"{self.args.uid}:{self.args.gid}",
            "uid": self.args.uid,
            "gid": self.args.gid,
            "chroot": str(self.args.chroot) if self.args.chroot is not None else None,
            "capabilities": f"none after the drop (bounding set before it: {JAIL_BOUNDING_SET})",
            "no_new_privs": True,
            "seccomp": sandbox(request, True),
        }
