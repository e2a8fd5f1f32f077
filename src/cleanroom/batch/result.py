"""What a run returns: one ``EpisodeResult`` per episode, gathered in a ``RunResult``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from cleanroom.batch.group_report import GroupReport
from cleanroom.core.states import Outcome
from cleanroom.errors import StoreError
from cleanroom.lifecycle.episode import EpisodeResult
from cleanroom.store import Store, layout

__all__ = ["EpisodeResult", "RunResult"]


@dataclass
class RunResult:
    run_id: str
    episodes: list[EpisodeResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already durable (resumed run)
    leaked_envs: list[str] = field(default_factory=list)
    groups: list[GroupReport] = field(default_factory=list)  # episodes sharing a setup
    store: Store | None = None  # where the records are (``record`` of a skipped episode)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.episodes:
            out[e.outcome.value] = out.get(e.outcome.value, 0) + 1
        return out

    @property
    def ok(self) -> bool:
        return not self.leaked_envs and all(e.outcome == Outcome.COMPLETED for e in self.episodes)

    def ordered(self, episode_ids: list[str], store: Store | None = None) -> RunResult:
        """This result with ``episodes`` in the order of ``episode_ids`` (the input order; they
        finish in any order) and ``store`` attached for ``record``/``artifact_path``."""
        rank = {eid: i for i, eid in enumerate(episode_ids)}
        self.episodes.sort(key=lambda e: rank.get(e.episode_id, len(rank)))
        self.store = store or self.store
        return self

    def rewards(self) -> dict[str, float | None]:
        """Episode id -> reward (None where the episode gave none), in episode order."""
        return {e.episode_id: e.reward for e in self.episodes}

    def record(self, episode_id: str) -> dict[str, Any]:
        """The durable result record of ``episode_id`` (from this run, or the store for an
        episode a resumed run skipped); StoreError if it has none."""
        for episode in self.episodes:
            if episode.episode_id == episode_id and episode.record is not None:
                return episode.record
        found = self.store.get_record(self.run_id, episode_id) if self.store else None
        if found is None:
            known = [e.episode_id for e in self.episodes] + self.skipped
            why = "not in this run" if episode_id not in known else "it has no durable record"
            raise StoreError(f"run {self.run_id}: no record for episode {episode_id!r} ({why})")
        return found

    def artifact_path(self, episode_id: str, name: str) -> Path:
        """Where artifact ``name`` of ``episode_id`` lies in a local store (StoreError for an
        artifact the record does not list, or a store that is not a local folder)."""
        record = self.record(episode_id)
        names = [a.get("name") for a in record.get("artifacts") or []]
        rel = layout.listed(record, "artifacts", name)
        if rel is None:
            raise StoreError(
                f"run {self.run_id}: episode {episode_id!r} has no artifact {name!r} "
                f"(it has {', '.join(map(str, names)) or 'none'})"
            )
        assert self.store is not None  # a record was found, so there is a store or an episode
        uri = urlparse(self.store.episode_uri(self.run_id, episode_id))
        if uri.scheme != "file":
            raise StoreError(f"{uri.geturl()}: not a local folder; read the artifact with fsspec")
        return Path(unquote(uri.path)) / rel
