"""The qemu driver's command line: the microVM, its devices and the guest kernel's arguments.

A template and its clones must have identical devices, so ``machine_args`` is the one place
that lists them (the template key hashes it); ``command`` adds the per-env parts (the marker
name, the fds of the agent channel's and the QMP monitor's socket pairs: no socket paths; the
bulk disk's file, ``agent.bulk``; the jail: ``-runas UID:GID`` and ``-chroot DIR``) and wraps
it in ``hostproc.supervised``.

A jailed QEMU opens everything it needs (kernel, initrd, disk, RAM file, inherited fds) as
root, then chroots into an empty folder and drops to its uid (QEMU's ``os_setup_post``, before
its main loop). Its seccomp filter must then allow the set*id calls it makes itself
(``elevateprivileges=allow``: ``SANDBOX_JAILED``); after the drop it has no capability left to
gain anything with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cleanroom.agent import bulk
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers.base import EnvRequest
from cleanroom.host import hostproc
from cleanroom.network import qemu_args as net_args

MACHINE = "microvm,x-option-roms=off,isa-serial=on,rtc=on,pit=on"
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
SANDBOX_JAILED = "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"


@dataclass(frozen=True)
class JailArgs:
    """Who a jailed QEMU becomes: its uid and gid, and its root (None: no chroot)."""

    uid: int
    gid: int
    chroot: Path | None

    def args(self) -> list[str]:
        root = ["-chroot", str(self.chroot)] if self.chroot is not None else []
        return ["-runas", f"{self.uid}:{self.gid}", *root]


def sandbox(request: EnvRequest, jailed: bool) -> str:
    """The ``-sandbox`` seccomp policy (module docstring; egress: ``net_args``)."""
    if request.network is not None:
        return net_args.SANDBOX_NETWORKED
    return SANDBOX_JAILED if jailed else SANDBOX


# clearcpuid=erms,rep_good: the kernel copies and clears memory with unrolled loops instead of
# `rep movs/stos`, which TCG runs one iteration per step: ~10% less CPU for a cold boot and a
# clone's first steps (A/B, QEMU CPU time). It marks the guest kernel tainted 'S' (cosmetic).
GUEST_CMDLINE = (
    "console=ttyS0 quiet panic=-1 reboot=t tsc=reliable tsc_early_khz={khz} "
    "cryptomgr.notests random.trust_cpu=on mitigations=off nokaslr 8250.nr_uarts=1 "
    "initcall_blacklist=init_kprobe_trace,load_system_certificate_list "
    "clearcpuid=erms,rep_good"
)


def machine_args(
    request: EnvRequest,
    accel: accel_mod.Accel,
    *,
    memory_backend: bool = False,
    jailed: bool = False,
) -> list[str]:
    """The machine and its devices: identical for a template and its clones."""
    b, lim = request.baseline, request.limits
    return [
        "-M",
        MACHINE + (",memory-backend=mem" if memory_backend else ""),
        *accel.qemu_args(),
        "-m",
        str(lim.memory_mib),
        "-smp",
        str(lim.vcpus),
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-sandbox",
        sandbox(request, jailed),
        "-serial",
        "stdio",
        "-kernel",
        str(b.kernel),
        "-initrd",
        str(b.initrd),
        "-append",
        GUEST_CMDLINE.format(khz=accel_mod.host_tsc_khz()) + accel.guest_cmdline(),
        "-drive",
        f"id=root,file={b.rootfs},format=raw,if=none,readonly=on",
        "-device",
        "virtio-blk-device,drive=root",
        "-device",
        "virtio-serial-device",
        "-device",
        "virtserialport,chardev=ctl,name=ctl",
        *bulk.DEVICE,
        *(net_args.netdev_args(request.network) if request.network else []),
    ]


def command(
    request: EnvRequest,
    accel: accel_mod.Accel,
    extra: list[str] | None = None,
    *,
    ctl_fd: int,
    qmp_fd: int,
    bulk_disk: Path,
    memory_backend: bool = False,
    jail: JailArgs | None = None,
) -> list[str]:
    """The supervised QEMU command line of one env (``extra``: memory, incoming, monitors)."""
    jailed = jail is not None
    qemu = [
        accel_mod.QEMU,
        "-name",
        hostproc.marker(request.env_id),
        *machine_args(request, accel, memory_backend=memory_backend, jailed=jailed),
        "-chardev",
        f"socket,id=ctl,fd={ctl_fd}",  # the guest's end of the agent channel's socket pair
        "-chardev",
        f"socket,id=qmp,fd={qmp_fd}",  # QEMU's end of the QMP monitor's socket pair
        "-mon",
        "chardev=qmp,mode=control",
        *bulk.qemu_args(bulk_disk),
        *(extra or []),
        *(jail.args() if jail is not None else []),
    ]
    return hostproc.supervised(qemu, request.hard_deadline_s, jailed=jailed)
