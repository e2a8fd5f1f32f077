"""Run events from parts below the controller, e.g. a driver building a snapshot template.

The controller hands its ``on_event`` hook to what it calls, but a driver is shared by runs and
never sees it. ``api.arun`` puts the run's hook in a context variable for the run's duration
(``hooked``); asyncio tasks and ``to_thread`` calls started inside copy it, so a driver part
says ``emit("template_building", ...)`` and the run's progress, logs and ledger hear it. With no
hook set (a driver used on its own) ``emit`` does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

Hook = Callable[[str, dict[str, Any]], None]
_HOOK: ContextVar[Hook | None] = ContextVar("cleanroom_run_events", default=None)


def emit(kind: str, **data: Any) -> None:
    """Send one event to the current run's hook, if there is one."""
    hook = _HOOK.get()
    if hook is not None:
        hook(kind, data)


@contextmanager
def hooked(hook: Hook | None) -> Iterator[None]:
    """Make ``hook`` the receiver of ``emit`` in this context (and tasks started in it)."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)
