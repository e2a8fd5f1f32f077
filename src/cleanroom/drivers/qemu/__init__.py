"""The qemu driver: one ``-M microvm`` QEMU process per environment (``driver.py``)."""

from __future__ import annotations

from cleanroom.drivers.qemu.driver import START_ENV, STARTS, QemuDriver

__all__ = ["STARTS", "START_ENV", "QemuDriver"]
