"""The KVM probe's choice, across event loops (no VM: the probe itself is replaced)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers import accel

from ..conftest import make_fake_baseline


def test_two_runs_in_one_process_each_probe_under_their_own_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cleanroom.run`` twice in one process is two event loops. Envs of each wait on the probe
    lock; a module-level ``asyncio.Lock`` bound itself to the first loop and failed every env of
    the second with "bound to a different event loop" (seen as infra_error in CI)."""
    monkeypatch.delenv("CLEANROOM_ACCEL", raising=False)
    monkeypatch.setattr(accel, "_kvm_openable", lambda: True)
    probes: list[str] = []

    async def probe(baseline: Baseline) -> tuple[bool, str]:
        probes.append(baseline.kernel_version)
        await asyncio.sleep(0.05)  # the others wait on the lock meanwhile
        return False, "probe replaced by the test"

    monkeypatch.setattr(accel, "_probe_kvm", probe)
    baseline = make_fake_baseline(tmp_path / "b")

    async def three_envs(home: str) -> list[str]:
        monkeypatch.setenv("CLEANROOM_HOME", home)
        chosen = await asyncio.gather(*(accel.choose(baseline) for _ in range(3)))
        return [c.name for c in chosen]

    assert asyncio.run(three_envs(str(tmp_path / "h1"))) == ["tcg"] * 3
    assert asyncio.run(three_envs(str(tmp_path / "h2"))) == ["tcg"] * 3
    assert len(probes) == 2  # once per home: the others found the cached verdict


def test_only_tcg_guests_run_with_one_address_layout() -> None:
    """Under TCG a guest gets ``norandmaps`` (translated code is keyed by virtual address, so a
    repeated command reuses the loader's and libc's); under KVM its ASLR stays on."""
    tcg = accel.Accel("tcg", "7.2", "test")
    kvm = accel.Accel("kvm", "7.2", "test")
    assert "norandmaps" in tcg.guest_cmdline().split()
    assert "norandmaps" not in kvm.guest_cmdline().split()
