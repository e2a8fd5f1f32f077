"""Drivers create and destroy environments (one VM or sandbox each).

``get_driver(name)`` maps a name to an instance: ``qemu`` (microVM; KVM when usable, else TCG),
``gvisor`` (a runsc sandbox: gVisor's user-space kernel, no VM), ``fake`` (the real agent as a
host process, no isolation; for tests), ``fake-snap`` (the fake with a faithful fake
snapshot of its files: fork, pause, resume; for tests), ``auto``: qemu when KVM is known to
work here (hardware isolation, fast), otherwise ``$CLEANROOM_DRIVER_DEFAULT`` (``qemu`` or
``gvisor``; ``qemu`` when unset).
"""

from __future__ import annotations

import os

from cleanroom.drivers.base import Driver
from cleanroom.errors import ConfigError

DRIVERS = ("qemu", "gvisor", "fake", "fake-snap", "auto")
DEFAULT_ENV = "CLEANROOM_DRIVER_DEFAULT"


def auto_choice() -> str:
    """The driver ``auto`` stands for on this host (``qemu`` or ``gvisor``)."""
    from cleanroom.drivers.accel import kvm_known_usable

    default = os.environ.get(DEFAULT_ENV, "qemu").strip().lower() or "qemu"
    if default not in ("qemu", "gvisor"):
        raise ConfigError(f"{DEFAULT_ENV} must be qemu or gvisor (not {default!r})")
    return "qemu" if kvm_known_usable() else default


def get_driver(name: str) -> Driver:
    if name == "auto":
        name = auto_choice()
    if name == "qemu":
        from cleanroom.drivers.qemu import QemuDriver

        return QemuDriver()
    if name == "gvisor":
        from cleanroom.drivers.gvisor import GvisorDriver

        return GvisorDriver()
    if name == "fake":
        from cleanroom.drivers.fake import FakeDriver

        return FakeDriver()
    if name == "fake-snap":
        from cleanroom.drivers.fake_snap import SnapshotFake

        return SnapshotFake()
    raise ConfigError(f"unknown driver {name!r}; choose one of {', '.join(DRIVERS)}")


__all__ = ["DRIVERS", "Driver", "auto_choice", "get_driver"]
