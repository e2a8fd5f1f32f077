"""An episode's phase timings, lap by lap: durations for its record, and wall-clock spans."""

from __future__ import annotations

import time


class EpisodeClock:
    """Phase timings of one episode: ``phases`` (seconds) and ``spans`` (unix start/end)."""

    def __init__(self, queue_s: float) -> None:
        self.phases: dict[str, float] = {"queue_s": round(queue_s, 6)}
        self.started_at = time.time()
        self.spans: dict[str, dict[str, float]] = {
            "queue": {"start": round(self.started_at - queue_s, 6), "end": self.started_at}
        }
        self._last = time.monotonic()
        self._last_wall = self.started_at

    def lap(self, name: str) -> None:
        now, wall = time.monotonic(), time.time()
        self.phases[name] = round(now - self._last, 6)
        self.spans[name.removesuffix("_s")] = {"start": self._last_wall, "end": wall}
        self._last, self._last_wall = now, wall
