"""Sealing a fork snapshot (no VM): the files are frozen first and hashed meanwhile; a change
between the freeze and the end of the hash leaves the snapshot unsealed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cleanroom.drivers import snapshot
from cleanroom.drivers.qemu import seal as qemu_seal
from cleanroom.errors import DriverError

PAST = 1_600_000_000  # file times set before the freeze, so any change moves them


def make_snapshot(folder: Path) -> Path:
    folder.mkdir()
    with (folder / snapshot.RAM_FILE).open("wb") as f:
        f.truncate(4 << 20)  # mostly holes, like a guest's RAM file
        f.seek(1 << 20)
        f.write(b"warm state")
    (folder / snapshot.STATE_FILE).write_bytes(b"device state")
    for name in snapshot.FILES:
        os.utime(folder / name, (PAST, PAST))
    return folder


def test_a_frozen_snapshot_is_hashed_and_recorded(tmp_path: Path) -> None:
    folder = make_snapshot(tmp_path / "snap-a")
    frozen = qemu_seal.freeze(folder)
    assert all((folder / name).stat().st_mode & 0o777 == 0o444 for name in snapshot.FILES)
    meta = qemu_seal.hash_files(folder, frozen)
    assert meta["digest"].startswith("sha256:") and meta["signature"] == frozen["signature"]
    again = qemu_seal.hash_files(folder, frozen)
    assert again["digest"] == meta["digest"]
    assert (folder / qemu_seal.META_FILE).is_file()


def test_a_snapshot_changed_after_its_freeze_is_not_sealed(tmp_path: Path) -> None:
    folder = make_snapshot(tmp_path / "snap-b")
    frozen = qemu_seal.freeze(folder)
    ram = folder / snapshot.RAM_FILE
    ram.chmod(0o644)  # e.g. while the hash runs: same size, other bytes
    with ram.open("r+b") as f:
        f.seek(1 << 20)
        f.write(b"cold state")
    with pytest.raises(DriverError, match=r"changed while sealed \(ram\)"):
        qemu_seal.hash_files(folder, frozen)
    assert not (folder / qemu_seal.META_FILE).exists()
