"""Fixtures for the observability tests: a fake-driver controller with a chosen event hook."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.batch.runner import Controller, EventHook, RunOptions

from ..batch.test_controller import Harness


class Observed(Harness):
    """The controller harness of tests/batch/test_controller.py, with ``hook`` on its events."""

    def observe(self, hook: EventHook, *, parallel: int = 2, cleanup_window_s: float = 5) -> None:
        self.ctl = Controller(
            self.driver,
            self.ledger,
            self.store,
            options=RunOptions(
                parallel=parallel,
                cleanup_window_s=cleanup_window_s,
                staging_dir=self.tmp / "staging",
            ),
            on_event=hook,
        )


@pytest.fixture
def obs(tmp_path: Path) -> Iterator[Observed]:
    harness = Observed(tmp_path)
    yield harness
    harness.ledger.close()
