"""Fixtures of the snapshot tests: a controller over a qemu driver that starts from snapshots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.drivers.qemu import QemuDriver

from ... import vmkit


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[vmkit.Harness]:
    yield from vmkit.harness(tmp_path, QemuDriver(start="snapshot"))
