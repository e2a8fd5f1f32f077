"""A deliberately broken driver: every env shares one persistent guest root on the host.

It is the fake driver (the real agent as a host process) except that ``guest_prefix`` -- where
an env's ``/`` lies on the host -- is one folder for all envs and survives ``destroy``: what an
environment "reset in place" or reused between episodes looks like. ``cleanroom check
isolation`` must fail on it.
"""

from __future__ import annotations

from pathlib import Path

from cleanroom.drivers.fake import FakeDriver


class ReusingDriver(FakeDriver):
    name = "reusing"

    def __init__(self, *, run_root: Path, shared: Path | None = None) -> None:
        super().__init__(run_root=run_root)
        self.shared = shared or run_root / "shared-root"

    def guest_prefix(self, env_id: str) -> str:
        self.shared.mkdir(parents=True, exist_ok=True)
        return str(self.shared)
