"""What happened to one group of a run (``RunResult.groups``), and a group's member type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cleanroom.evidence.manifest import Manifest

Member = tuple[Manifest, int]  # a manifest and the attempt it runs as


@dataclass
class GroupReport:
    """What happened to one group in a run (``RunResult.groups``)."""

    group_id: str
    mode: str  # "fork" or "per-episode"
    episodes: list[str]
    setup_digest: str
    snapshot_id: str | None = None
    snapshot: str | None = None  # the snapshot's digest
    digest: str | None = None  # over setup_digest and snapshot
    parent_env: str | None = None
    # parent_s, setup_s; snapshot_s: saved, parent gone, files frozen; seal_s: digest known
    timings: dict[str, float] = field(default_factory=dict)
    classification: str | None = None  # setup_failed, fork_failed, cancelled
    error: str | None = None
    snapshot_deleted: bool | None = None
    leaked: list[str] = field(default_factory=list)  # parent env / snapshot not confirmed gone

    def facts(self) -> dict[str, Any]:
        """``provenance.group`` of each of its episodes."""
        out = {
            "id": self.group_id,
            "mode": self.mode,
            "setup_digest": self.setup_digest,
            "snapshot": self.snapshot,
            "digest": self.digest,
            "snapshot_id": self.snapshot_id,
            "parent_env": self.parent_env,
            **{k: round(v, 4) for k, v in self.timings.items()},
        }
        return {k: v for k, v in out.items() if v is not None}
