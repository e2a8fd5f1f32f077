"""``cleanroom doctor``: what this host has and lacks for cleanroom, each gap with its fix.

One ``Finding`` per part: QEMU (and its version), whether KVM is usable (the cached probe; else
TCG and what it costs), runsc, the cgroup layout, the baseline builder's tools and its sandbox
(a ``true`` run confined, ``baseline.confine``), free disk under
the home, and the home's ownership and modes. ``fail`` is something ``make demo`` cannot do
without; ``warn`` works, slower or with less; ``ok`` is fine. Nothing here starts a VM: the KVM
verdict is the one the first qemu env recorded (``drivers.accel``).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cleanroom.host import paths

MIN_FREE_GIB = 2.0  # a baseline (~0.3 GiB), its template (~0.3 GiB) and the download caches
BUILD_TOOLS = {  # tool -> the Debian package that has it
    "mmdebstrap": "mmdebstrap",
    "mkfs.erofs": "erofs-utils",
    "lz4": "lz4",
    "cpio": "cpio",
    "busybox": "busybox-static",
    "gcc": "gcc",
    "tar": "tar",
}
TCG_COST = (
    "TCG will be used: the guest CPU is emulated (cold boot ~7 s, snapshot clone ~0.35 s, "
    "Python ~5-10x slower than native)"
)


@dataclass(frozen=True)
class Finding:
    part: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Host:
    """What the checks look at (a test hands in a bare one)."""

    which: Callable[[str], str | None] = shutil.which
    cgroup_root: Path = Path("/sys/fs/cgroup")
    kvm: Callable[[], bool | None] = field(default=lambda: _kvm_verdict())
    home: Callable[[], Path] = paths.home
    sandbox: Callable[[], str | None] = field(default=lambda: _sandbox_probe())


def _kvm_verdict() -> bool | None:
    from cleanroom.drivers.accel import kvm_known_usable

    return kvm_known_usable()


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "version unknown"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else "version unknown"


def qemu(host: Host) -> Finding:
    path = host.which("qemu-system-x86_64")
    if path is None:
        return Finding(
            "qemu",
            "fail",
            "qemu-system-x86_64 is not installed",
            "apt-get install qemu-system-x86   (or: make setup)",
        )
    return Finding("qemu", "ok", f"{_version([path, '--version'])} ({path})")


def kvm(host: Host) -> Finding:
    forced = os.environ.get("CLEANROOM_ACCEL", "auto").lower()
    verdict = host.kvm()
    if verdict is True:
        why = "forced by CLEANROOM_ACCEL" if forced == "kvm" else "the cached probe booted a guest"
        return Finding("kvm", "ok", f"KVM is usable ({why}): hardware-virtualized VMs")
    if verdict is None:
        return Finding(
            "kvm",
            "warn",
            "/dev/kvm opens; not probed yet on this boot (the first "
            "qemu env boots a kernel under KVM, at most 15 s, and caches the verdict)",
            "cleanroom run ... (or: make demo) probes it",
        )
    why = "forced by CLEANROOM_ACCEL" if forced == "tcg" else "no usable /dev/kvm"
    return Finding(
        "kvm",
        "warn",
        f"{TCG_COST}; {why}",
        "use a host with VT-x/AMD-V and nested KVM, or --driver gvisor "
        "(native CPU speed, a weaker boundary)",
    )


def runsc(host: Host) -> Finding:
    path = host.which("runsc")
    if path is None:
        return Finding(
            "runsc",
            "warn",
            "runsc is not installed: --driver gvisor is unavailable",
            "apt-get install runsc   (or: make setup)",
        )
    return Finding("runsc", "ok", f"{_version([path, '--version'])} ({path})")


def cgroups(host: Host) -> Finding:
    root = host.cgroup_root
    if (root / "cgroup.controllers").is_file():
        controllers = (root / "cgroup.controllers").read_text().split()
        return Finding("cgroups", "ok", f"cgroup v2 at {root}: {' '.join(controllers)}")
    v1 = [name for name in ("memory", "pids", "cpu", "freezer") if (root / name).is_dir()]
    unified = root / "unified"
    if v1 and (unified / "cgroup.procs").is_file():
        return Finding("cgroups", "ok", f"hybrid: v1 {', '.join(v1)}; cgroup v2 at {unified}")
    if v1:
        return Finding(
            "cgroups",
            "warn",
            f"cgroup v1 only ({', '.join(v1)}): no cgroup.kill",
            f"mount -t cgroup2 none {unified}",
        )
    return Finding(
        "cgroups",
        "warn",
        f"no cgroup hierarchy under {root}: limits for gvisor and the jailed QEMU cannot be set",
        "mount -t cgroup2 none /sys/fs/cgroup",
    )


def build_tools(host: Host) -> Finding:
    missing = {tool: pkg for tool, pkg in BUILD_TOOLS.items() if host.which(tool) is None}
    if not missing:
        return Finding("builder", "ok", f"baseline build tools: {', '.join(BUILD_TOOLS)}")
    packages = " ".join(sorted(set(missing.values())))
    return Finding(
        "builder",
        "fail",
        f"missing for baseline builds: {', '.join(missing)}",
        f"apt-get install {packages}   (or: make setup)",
    )


def _sandbox_probe() -> str | None:
    """Run ``true`` in the build sandbox (``baseline.confine``); None if it ran, else why not."""
    from cleanroom.baseline import confine
    from cleanroom.errors import CleanroomError

    if os.geteuid() != 0:
        return "not root: the build sandbox maps an id range, which needs root"
    try:
        with confine.workspace(paths.cache_dir()) as ws:
            confine.run_builder(ws, ["/bin/true"], "doctor", timeout_s=30)
    except (CleanroomError, OSError) as exc:
        return str(exc).splitlines()[0]
    return None


def build_sandbox(host: Host) -> Finding:
    problem = host.sandbox()
    if problem is None:
        return Finding("sandbox", "ok", "image builds run confined (user namespaces, own id range)")
    return Finding(
        "sandbox",
        "fail",
        f"baselines cannot be built here: {problem}",
        "run as root on a kernel with user namespaces (sysctl user.max_user_namespaces > 0)",
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk(host: Host) -> Finding:
    home = host.home()
    free = shutil.disk_usage(_existing(home)).free / 2**30
    if free < MIN_FREE_GIB:
        return Finding(
            "disk",
            "fail",
            f"{free:.1f} GiB free under {home} (need {MIN_FREE_GIB})",
            "free some space, or export CLEANROOM_HOME=/a/larger/disk",
        )
    return Finding("disk", "ok", f"{free:.1f} GiB free under {home}")


def home_modes(host: Host) -> Finding:
    home = host.home()
    if not home.exists():
        return Finding("home", "ok", f"{home} does not exist yet (made on first use)")
    info = home.stat()
    if info.st_uid != os.geteuid():
        return Finding(
            "home",
            "fail",
            f"{home} is owned by uid {info.st_uid}, not you (uid {os.geteuid()})",
            f"chown -R {os.geteuid()} {home}",
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return Finding(
            "home",
            "fail",
            f"{home} is writable by others (mode {stat.filemode(info.st_mode)})",
            f"chmod go-w {home}",
        )
    return Finding("home", "ok", f"{home} (yours, mode {stat.filemode(info.st_mode)})")


CHECKS = (qemu, kvm, runsc, cgroups, build_tools, build_sandbox, disk, home_modes)


def diagnose(host: Host | None = None) -> list[Finding]:
    """Every check, in order."""
    host = host or Host()
    return [check(host) for check in CHECKS]
