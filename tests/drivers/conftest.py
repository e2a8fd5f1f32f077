"""The driver kit: one fixture that hands the conformance suite any driver, ready to use.

``kit`` is parametrized over every driver: ``fake`` (the native agent as a host process, with
the fake baseline), ``gvisor`` and ``qemu`` (the tiny test baseline, also on the native agent;
marked ``vm``). gVisor is skipped, with the reason, when ``runsc`` is missing or cannot run a
sandbox here.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers.base import Driver, Env, EnvRequest, Owner, new_env_id
from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver

from ..conftest import make_fake_baseline

ISOLATION = {"fake": {"none"}, "gvisor": {"userspace-kernel"}}
ISOLATION["qemu"] = {"hardware-vm", "emulated-vm"}
# the hard deadline must leave room for the boot: ~6 s for a QEMU guest under TCG here
DEADLINE_S = {"fake": 4.0, "gvisor": 8.0, "qemu": 18.0}
SNAPSHOT_DEADLINE_S = 5.0  # a qemu env restored from a template has no boot to wait for


@dataclass
class Kit:
    """A driver, a baseline it can run, and what differs between drivers for the tests."""

    name: str
    driver: Driver
    baseline: Baseline
    python: str  # the guest's python (the host's, for the fake driver)
    scratch: str  # a writable folder in the guest
    tmp: Path
    run_root: Path  # the driver's run folders
    envs: list[Env] = field(default_factory=list)

    @property
    def deadline_s(self) -> float:
        return DEADLINE_S[self.name]

    async def short_deadline_s(self) -> float:
        """The shortest hard deadline a new env of this kit survives its start with: for qemu,
        once an env has come from a snapshot (its template built), a clone's; else a boot's."""
        if self.name != "qemu":
            return self.deadline_s
        first = await self.create()
        from_snapshot = first.info.start_kind == "snapshot"
        await first.aclose()
        return SNAPSHOT_DEADLINE_S if from_snapshot else self.deadline_s

    async def create(self, hard_deadline_s: float = 300.0) -> Env:
        request = EnvRequest(
            new_env_id(),
            self.baseline,
            ResolvedLimits(timeout_s=60, vcpus=1, memory_mib=256),
            Owner("conformance"),
            hard_deadline_s=hard_deadline_s,
        )
        env = await self.driver.create(request)
        self.envs.append(env)
        return env


KITS = ("fake", "gvisor", "qemu")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every kit for a suite that uses ``kit``."""
    if "kit" not in metafunc.fixturenames:
        return
    params = [pytest.param(k, marks=() if k == "fake" else (pytest.mark.vm,), id=k) for k in KITS]
    metafunc.parametrize("kit", params, indirect=True)


@pytest.fixture
async def kit(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Kit]:
    name = str(request.param)
    driver: Driver
    if name == "fake":
        baseline = make_fake_baseline(tmp_path)
        driver = FakeDriver(run_root=tmp_path / "run")
        python, scratch = sys.executable, str(tmp_path / "guest-scratch")
    else:
        if name == "gvisor":
            request.getfixturevalue("gvisor_usable")
        baseline = request.getfixturevalue("tiny_baseline")
        if name == "gvisor":
            driver = GvisorDriver(run_root=tmp_path / "run")
        else:
            driver = QemuDriver(run_root=tmp_path / "run")
        python, scratch = "python3", "/root/conformance"
    kit = Kit(name, driver, baseline, python, scratch, tmp_path, tmp_path / "run")
    yield kit
    for env in kit.envs:  # whatever a failing test left behind
        await env.aclose()
