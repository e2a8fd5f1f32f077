"""A reaper per node: a detached actor, named per node and driver, that reaps periodically.

It outlives every run and driver, so what a node's controller actor left when it died (its VMs
are killed by their parent-death signal; their ledger rows stay unconfirmed until a reap) is
destroyed, confirmed and marked even if no run comes to that node again. The deadman (each VM's
hard deadline) and the boot-time reap stay the backstop.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from cleanroom.drivers import get_driver
from cleanroom.errors import CleanroomError
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.reaper import reap
from cleanroom.store import open_store

PERIOD_S = 30.0


class NodeReaper:
    """``reap`` on this node every ``period_s`` (its own ledger, the run's store)."""

    def __init__(self, driver: str, store: str, period_s: float = PERIOD_S) -> None:
        self.driver, self.ledger, self.store = get_driver(driver), Ledger(), open_store(store)
        self.period_s, self.rounds, self.reaped = period_s, 0, 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Start the loop (idempotent); the rounds done so far."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())
        return self.rounds

    async def stats(self) -> dict[str, int]:
        return {"rounds": self.rounds, "reaped": self.reaped}

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(CleanroomError, OSError):  # the next round tries again
                report = await reap(self.driver, self.ledger, self.store)
                self.reaped += len(report.destroyed)
            self.rounds += 1
            await asyncio.sleep(self.period_s)


def ensure_reaper(node_id: str, driver: str, store: str, period_s: float = PERIOD_S) -> Any:
    """The node's reaper actor for ``driver`` and ``store`` (started once, found by name)."""
    import hashlib

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where = hashlib.sha256(store.encode()).hexdigest()[:12]  # one reaper per store it checks
    handle: Any = (
        ray.remote(NodeReaper)
        .options(
            name=f"cleanroom-reaper-{driver}-{where}-{node_id}",
            namespace="cleanroom",
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,  # a reaper should come back; it holds no episode
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(driver, store, period_s)
    )
    handle.start.remote()
    return handle
