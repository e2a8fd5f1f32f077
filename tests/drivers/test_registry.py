"""``get_driver``: names map to drivers; ``auto`` is qemu on a working KVM, else the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cleanroom.drivers import accel, auto_choice, get_driver
from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import ConfigError


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))
    monkeypatch.delenv("CLEANROOM_ACCEL", raising=False)
    monkeypatch.delenv("CLEANROOM_DRIVER_DEFAULT", raising=False)
    return tmp_path


def test_names(home: Path) -> None:
    assert isinstance(get_driver("qemu"), QemuDriver)
    assert isinstance(get_driver("gvisor"), GvisorDriver)
    assert isinstance(get_driver("fake"), FakeDriver)
    with pytest.raises(ConfigError, match="unknown driver"):
        get_driver("docker")


def test_auto_uses_the_default_when_kvm_is_unknown(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(accel, "_kvm_openable", lambda: True)
    assert accel.kvm_known_usable() is None
    assert auto_choice() == "qemu"
    monkeypatch.setenv("CLEANROOM_DRIVER_DEFAULT", "gvisor")
    assert isinstance(get_driver("auto"), GvisorDriver)
    monkeypatch.setenv("CLEANROOM_DRIVER_DEFAULT", "firecracker")
    with pytest.raises(ConfigError, match="CLEANROOM_DRIVER_DEFAULT"):
        auto_choice()


def test_auto_reads_the_cached_kvm_probe(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accel, "_kvm_openable", lambda: True)
    monkeypatch.setenv("CLEANROOM_DRIVER_DEFAULT", "gvisor")
    boot = accel._boot_id()
    probe = home / "accel-probe.json"
    probe.write_text(json.dumps({f"{boot}|9.0|6.1": {"kvm": True, "reason": "booted"}}))
    assert accel.kvm_known_usable() is True and auto_choice() == "qemu"
    probe.write_text(json.dumps({f"{boot}|9.0|6.1": {"kvm": False, "reason": "hangs"}}))
    assert accel.kvm_known_usable() is False and auto_choice() == "gvisor"
    probe.write_text(json.dumps({"another-boot|9.0|6.1": {"kvm": True, "reason": "old"}}))
    assert accel.kvm_known_usable() is None and auto_choice() == "gvisor"


def test_forced_accel_and_missing_kvm(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANROOM_DRIVER_DEFAULT", "gvisor")
    monkeypatch.setenv("CLEANROOM_ACCEL", "kvm")
    assert auto_choice() == "qemu"
    monkeypatch.setenv("CLEANROOM_ACCEL", "tcg")
    assert auto_choice() == "gvisor"
    monkeypatch.delenv("CLEANROOM_ACCEL")
    monkeypatch.setattr(accel, "_kvm_openable", lambda: False)
    assert accel.kvm_known_usable() is False and auto_choice() == "gvisor"
