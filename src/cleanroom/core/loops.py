"""Asyncio primitives that outlive one event loop.

A module-level ``asyncio.Lock`` binds itself to the first loop that waits on it; a second
``asyncio.run`` in the same process (``cleanroom.run`` twice, a test suite) then fails with
"bound to a different event loop". ``loop_lock(name)`` gives one lock per (name, running loop).
"""

from __future__ import annotations

import asyncio
import weakref

_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def loop_lock(name: str) -> asyncio.Lock:
    """The lock called ``name`` of the running event loop (made on first use)."""
    locks = _LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault(name, asyncio.Lock())
