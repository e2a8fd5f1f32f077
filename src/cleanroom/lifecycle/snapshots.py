"""A fork snapshot's end: its files deleted with retries, the absence written to the ledger.

Groups (``batch/warm_parent.py``) and a session's branches (``sessions/fork.py``) delete their
snapshots through ``delete_snapshot``: a delete that cannot be confirmed leaves a ``leaked``
row, a ``snapshot_leaked`` event and an alert, and ``cleanroom reap`` tries again.
"""

from __future__ import annotations

import asyncio

from cleanroom.errors import CleanroomError
from cleanroom.lifecycle.context import RunContext

DELETE_TRIES = 5


async def delete_snapshot(ctx: RunContext, run_id: str, snapshot_id: str) -> bool:
    """Delete ``snapshot_id``'s files (``DELETE_TRIES`` tries, backing off); True once its
    absence is confirmed. The ledger row says which, either way."""
    gone = False
    for attempt in range(DELETE_TRIES):
        try:
            gone = await ctx.driver.delete_snapshot(snapshot_id)
        except (CleanroomError, OSError):
            gone = False
        if gone:
            break
        await asyncio.sleep(0.05 * 2**attempt)
    ctx.ledger.snapshot_deleted(snapshot_id, confirmed_absent=gone)
    if not gone:
        ctx.ledger.event("snapshot_leaked", run_id=run_id, snapshot_id=snapshot_id)
        ctx.emit("alert", message=f"snapshot {snapshot_id} still present after delete")
    return gone
