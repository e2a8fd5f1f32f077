"""The live environments of this host: what the ledger says, and what the driver really finds.

``cleanroom ps`` renders these rows; ``cleanroom ps --ray`` gathers them from every node of a
cluster (``integrations/ray/ps.py``), each node reading its own ledger and driver.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cleanroom.drivers.base import Driver
from cleanroom.ledger import Ledger


@dataclass(frozen=True)
class LiveEnv:
    """One env not yet confirmed absent (a ledger row), or one on the host the ledger lacks."""

    env_id: str
    age_s: float | None
    episode: str
    run: str
    owner_pid: int | None
    on_host: bool
    node: str = ""  # the cluster node it is on (``ps --ray``)

    def on_node(self, node: str) -> LiveEnv:
        return replace(self, node=node)


def live_envs(driver: Driver, ledger: Ledger | None = None) -> list[LiveEnv]:
    """The ledger's live envs (with whether the driver finds each), then the driver's envs the
    ledger does not know (a spare started ahead, or a leftover)."""
    now = time.time()
    on_host = set(driver.list_owned())
    if ledger is None:
        with Ledger() as opened:
            rows = opened.envs(live_only=True)
    else:
        rows = ledger.envs(live_only=True)
    out = [
        LiveEnv(
            r.env_id,
            now - r.intent_at if r.intent_at else None,
            r.episode_id or "",
            r.run_id or "",
            r.owner_pid,
            r.env_id in on_host,
        )
        for r in rows
    ]
    for env_id in sorted(on_host - {r.env_id for r in rows}):
        owner = driver.owner_of(env_id) or {}
        spare = (owner.get("labels") or {}).get("spare") == "true"  # started ahead, not yet used
        created = owner.get("created_at")
        pid = owner.get("pid")
        out.append(
            LiveEnv(
                env_id,
                now - created if isinstance(created, (int, float)) else None,
                "(spare, not in ledger)" if spare else "(not in ledger)",
                "",
                pid if isinstance(pid, int) else None,
                True,
            )
        )
    return out
