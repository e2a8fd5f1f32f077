"""Drivers create and destroy environments (one VM or sandbox each).

``get_driver(name)`` maps a name to an instance: ``qemu`` (microVM; KVM when usable, else TCG),
``fake`` (the real agent as a host process, no isolation; for tests), ``auto`` (qemu).
"""

from __future__ import annotations

from cleanroom.drivers.base import Driver
from cleanroom.errors import ConfigError

DRIVERS = ("qemu", "fake", "auto")


def get_driver(name: str) -> Driver:
    if name in ("qemu", "auto"):
        from cleanroom.drivers.qemu import QemuDriver

        return QemuDriver()
    if name == "fake":
        from cleanroom.drivers.fake import FakeDriver

        return FakeDriver()
    raise ConfigError(f"unknown driver {name!r}; choose one of {', '.join(DRIVERS)}")


__all__ = ["DRIVERS", "Driver", "get_driver"]
