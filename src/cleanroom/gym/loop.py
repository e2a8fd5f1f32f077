"""A private event loop on a daemon thread, for a synchronous API over async cleanroom parts.

Created on first use in the process that uses it: a fork (an ``AsyncVectorEnv`` worker) that
inherits one finds it belongs to another pid and makes its own, leaving the parent's alone.
Everything async (driver, ledger, sessions) is created and used on this one thread; the VMs'
launchers die with it (``setpriv --pdeathsig``: the parent *thread*), and with the process.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """``call(coro)`` runs a coroutine on the loop and returns its result (or raises)."""

    def __init__(self, name: str) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def owned(self) -> bool:
        """Whether this process made it (after a fork the thread does not exist here)."""
        return self.pid == os.getpid() and self._thread.is_alive()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        """Stop the loop and its thread (the caller has closed what ran on it)."""
        if self.owned():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)
            if not self._thread.is_alive():
                self.loop.close()
