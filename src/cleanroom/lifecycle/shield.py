"""Cleanup that must not be abandoned: await a task to its end through cancellation."""

from __future__ import annotations

import asyncio
from typing import Any


async def until_done(task: asyncio.Future[Any]) -> bool:
    """Await ``task`` to the end, even through repeated cancellation; True if we were cancelled.

    Cleanup must not be abandoned: asyncio.run() cancels every task left when the main task
    ends, so a cancelled episode keeps waiting here until its env is confirmed destroyed.
    """
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            return cancelled
        except asyncio.CancelledError:
            cancelled = True
            if task.done():
                return cancelled
