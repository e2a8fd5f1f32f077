"""What a run returns: one ``EpisodeResult`` per episode, gathered in a ``RunResult``."""

from __future__ import annotations

from dataclasses import dataclass, field

from cleanroom.batch.group_report import GroupReport
from cleanroom.lifecycle.episode import EpisodeResult
from cleanroom.record import Outcome

__all__ = ["EpisodeResult", "RunResult"]


@dataclass
class RunResult:
    run_id: str
    episodes: list[EpisodeResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already durable (resumed run)
    leaked_envs: list[str] = field(default_factory=list)
    groups: list[GroupReport] = field(default_factory=list)  # episodes sharing a setup

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.episodes:
            out[e.outcome.value] = out.get(e.outcome.value, 0) + 1
        return out

    @property
    def ok(self) -> bool:
        return not self.leaked_envs and all(e.outcome == Outcome.COMPLETED for e in self.episodes)
