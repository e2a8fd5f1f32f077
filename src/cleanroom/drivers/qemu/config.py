"""The qemu driver's settings, as each of its parts sees them (fixed once the driver is made)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cleanroom.errors import ConfigError

STARTS = ("auto", "cold", "snapshot")
START_ENV = "CLEANROOM_QEMU_START"  # the default of ``QemuDriver(start=...)``


@dataclass(frozen=True)
class QemuConfig:
    boot_timeout_s: float
    restore_timeout_s: float
    start: str  # one of STARTS
    run_root: Path  # run folders: <run_root>/<env_id>/
    name: str = "qemu"  # the driver's name (owner records, EnvInfo)
    jail: bool = True  # each QEMU in a jail of its own where the host allows (qemu/jail.py)

    def __post_init__(self) -> None:
        if self.start not in STARTS:
            raise ConfigError(f"start must be one of {', '.join(STARTS)} (not {self.start!r})")

    def run_dir(self, env_id: str) -> Path:
        return self.run_root / env_id
