"""What a part of the qemu driver may use: the driver builds one ``QemuContext`` and hands it
to each part (templates, clones, spares, fork), so no part imports or reaches into the driver.

``QemuConfig`` is the driver's settings, fixed at construction; ``live`` the envs this process
holds (shared, mutable: the launcher adds, ``destroy`` removes); ``launcher`` starts a QEMU
process (inside its env's cgroup, ``launcher.groups``) and waits for its agent; ``destroy`` is
the driver's (kill, remove, confirm absent).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cleanroom.drivers.base import DestroyReport
from cleanroom.drivers.qemu.config import QemuConfig
from cleanroom.drivers.qemu.launch import Launcher
from cleanroom.drivers.qemu.live import Live


@dataclass(frozen=True)
class QemuContext:
    """What a qemu part may use; the driver builds it, parts never see the driver."""

    config: QemuConfig
    live: dict[str, Live]
    launcher: Launcher
    destroy: Callable[[str], Awaitable[DestroyReport]]
