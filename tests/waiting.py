"""Polling under a deadline, for tests that wait on something another task or process does.

``await until(check, "what")`` calls ``check`` every ``every_s`` until it returns something
truthy (returned) and fails the test, naming ``what``, after ``timeout_s``: never a fixed sleep
followed by an assert, never a loop without an end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def until(
    check: Callable[[], T], what: str, timeout_s: float = 60.0, every_s: float = 0.02
) -> T:
    """``check()``'s first truthy value; AssertionError naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        await asyncio.sleep(every_s)


def until_sync(
    check: Callable[[], T], what: str, timeout_s: float = 60.0, every_s: float = 0.1
) -> T:
    """``until`` for a test without an event loop (it blocks while it polls)."""
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(every_s)
