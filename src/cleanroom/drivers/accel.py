"""Which accelerator QEMU can really use here: KVM when a guest boots under it, else TCG.

``/dev/kvm`` existing proves little (a nested PVM host has it and a standard guest kernel hangs
or QEMU aborts under it), so the probe boots the baseline's own kernel under KVM with a bounded
deadline and an init that powers off at once. The verdict is cached per host boot, QEMU version
and kernel, in ``$CLEANROOM_HOME/accel-probe.json``. ``CLEANROOM_ACCEL=kvm|tcg`` overrides it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.loops import loop_lock
from cleanroom.errors import ConfigError
from cleanroom.host import paths

QEMU = "qemu-system-x86_64"
PROBE_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Accel:
    name: str  # "kvm" or "tcg"
    qemu_version: str
    reason: str

    @property
    def isolation(self) -> str:
        return "hardware-vm" if self.name == "kvm" else "emulated-vm"

    def qemu_args(self) -> list[str]:
        if self.name == "kvm":
            return ["-accel", "kvm", "-cpu", "host"]
        return ["-accel", "tcg", "-cpu", "max"]

    def guest_cmdline(self) -> str:
        """Guest kernel arguments this accelerator wants (appended to the driver's own).

        TCG keys translated code by the virtual address it runs at, so with address-space
        randomization every new process translates the loader and libc again: a repeated
        ``true`` costs ~25 ms instead of ~7 (bench/session.py). ``norandmaps`` gives every
        process one layout under TCG; under KVM nothing is translated and ASLR stays on.
        """
        return "" if self.name == "kvm" else " norandmaps"


def qemu_version() -> str:
    try:
        out = subprocess.run([QEMU, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ConfigError(f"{QEMU} is not usable ({exc}); run `make setup`") from exc
    match = re.search(r"version (\S+)", out.stdout)
    return match.group(1) if match else out.stdout.strip()


def host_tsc_khz() -> int:
    """The host TSC frequency, passed to the guest so it never calibrates under TCG."""
    sysfs = Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz")
    if sysfs.exists():
        return int(sysfs.read_text().strip())
    text = Path("/proc/cpuinfo").read_text()
    match = re.search(r"cpu MHz\s*:\s*([\d.]+)", text)
    if not match:
        raise ConfigError("cannot read the host TSC frequency from /proc/cpuinfo")
    return int(float(match.group(1)) * 1000)


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _kvm_openable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


async def _probe_kvm(baseline: Baseline) -> tuple[bool, str]:
    """Boot the baseline kernel under KVM to an init that powers off; True if it does in time."""
    args = [
        QEMU,
        "-M",
        "microvm,x-option-roms=off,isa-serial=on,rtc=on,pit=on",
        "-accel",
        "kvm",
        "-cpu",
        "host",
        "-m",
        "128",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-serial",
        "stdio",
        "-kernel",
        str(baseline.kernel),
        "-initrd",
        str(baseline.initrd),
        "-append",
        "console=ttyS0 quiet panic=-1 rdinit=/bin/busybox -- poweroff -f",
    ]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return False, f"guest kernel did not boot under KVM within {PROBE_TIMEOUT_S:.0f}s"
    if proc.returncode != 0:
        tail = out.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        return False, f"QEMU failed under KVM (exit {proc.returncode}): {tail[0][:200]}"
    return True, "guest kernel booted under KVM"


def kvm_known_usable() -> bool | None:
    """A cheap, synchronous answer from what is already known: no probe, no QEMU call.

    True/False when ``CLEANROOM_ACCEL`` forces it, when ``/dev/kvm`` cannot be opened (False),
    or when the probe cache holds a verdict from this host boot (True if any kernel booted under
    KVM); None when nothing is known yet (the first qemu env will probe).
    """
    forced = os.environ.get("CLEANROOM_ACCEL", "auto").lower()
    if forced in ("kvm", "tcg"):
        return forced == "kvm"
    if not _kvm_openable():
        return False
    try:
        cached = json.loads((paths.home() / "accel-probe.json").read_text())
        boot = _boot_id()
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict):
        return None
    verdicts = [
        bool(v.get("kvm"))
        for k, v in cached.items()
        if isinstance(v, dict) and str(k).startswith(boot + "|")
    ]
    return any(verdicts) if verdicts else None


async def choose(baseline: Baseline) -> Accel:
    """Pick the accelerator for this baseline on this host (cached)."""
    version = qemu_version()
    forced = os.environ.get("CLEANROOM_ACCEL", "auto").lower()
    if forced in ("kvm", "tcg"):
        return Accel(forced, version, "forced by CLEANROOM_ACCEL")
    if forced != "auto":
        raise ConfigError(f"CLEANROOM_ACCEL must be auto, kvm or tcg (not {forced!r})")
    if not _kvm_openable():
        return Accel("tcg", version, "/dev/kvm is absent or not accessible")
    key = f"{_boot_id()}|{version}|{baseline.kernel_version}"
    cache = paths.home() / "accel-probe.json"
    async with loop_lock("accel-probe"):  # one probe at a time in this loop
        try:
            cached = json.loads(cache.read_text())
        except (OSError, ValueError):
            cached = {}
        if key not in cached:
            ok, reason = await _probe_kvm(baseline)
            cached = {key: {"kvm": ok, "reason": reason}}
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(cached))
    verdict = cached[key]
    return Accel("kvm" if verdict["kvm"] else "tcg", version, str(verdict["reason"]))
