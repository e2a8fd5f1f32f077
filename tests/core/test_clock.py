"""``EpisodeClock``: each phase's duration for the record and its wall-clock span, lap by lap.

A fake clock (monotonic and wall time set by the test): each lap's duration is the time since
the previous lap (the queue time at first), rounded to microseconds, and its span, named
without ``_s``, starts where the previous one ended, so the phases tile the episode.
"""

from __future__ import annotations

import pytest

from cleanroom.core import clock as clock_module
from cleanroom.core.clock import EpisodeClock


class FakeTime:
    def __init__(self) -> None:
        self.mono, self.wall = 100.0, 1000.0

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def test_laps_give_durations_and_contiguous_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Protects: the record's phase durations and spans (timings.*_s, timings.phases)."""
    t = FakeTime()
    monkeypatch.setattr(clock_module.time, "monotonic", lambda: t.mono)
    monkeypatch.setattr(clock_module.time, "time", lambda: t.wall)
    clock = EpisodeClock(0.1234567)
    assert clock.started_at == 1000.0
    assert clock.spans == {"queue": {"start": 999.876543, "end": 1000.0}}
    t.advance(0.1234567)
    clock.lap("provision_s")
    t.advance(2.0)
    clock.lap("run_s")
    assert clock.phases == {"queue_s": 0.123457, "provision_s": 0.123457, "run_s": 2.0}
    assert clock.spans["provision"] == {"start": 1000.0, "end": pytest.approx(1000.1234567)}
    assert clock.spans["run"] == {
        "start": clock.spans["provision"]["end"],
        "end": pytest.approx(1002.1234567),
    }
