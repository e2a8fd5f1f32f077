"""The guest paths a session's first steps take, taken once ahead: before a template's save
and in a spare's run ahead of its take.

Two costs make a clone's first file operation and first shell slow under TCG, both paid off
the episode's path here: the guest's page and dentry caches (a template saves them with its RAM,
so every clone has what its build VM touched: a clone's first ``sh`` 70-99 -> 39-44 ms, same
run) and QEMU's translation of each guest code path the first time a QEMU process runs it
(a spare's own QEMU process: its first read of /etc/hostname took 20-30 ms, the next 1-2).
``/bin/sh`` creates, writes and removes a file in /tmp (nothing is left; a baseline without a
shell runs nothing: exit 127, which still runs the agent's and the kernel's exec paths); the
host puts 64 KiB into /dev/null and reads /etc/passwd (through the bulk disk where the VM has
one, ``agent.bulk``: QEMU's disk paths and the agent's; else the channel's streams; /etc looked
up). A failure only leaves them cold.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from cleanroom.agent.connection import AgentConnection
from cleanroom.errors import CleanroomError

SCRIPT = 'f=/tmp/.cleanroom-touch-$$; echo > "$f"; rm -f "$f"'
READ = "/etc/passwd"
PUT = "/dev/null"  # written through, keeps nothing
PUT_BYTES = 64 * 1024
TIMEOUT_S = 10.0


async def touch_guest_paths(session: AgentConnection) -> dict[str, Any]:
    """Run the paths once; what ran (``sh``: its exit code, ``put`` and ``read``: bytes), for
    the facts."""
    touched: dict[str, Any] = {}
    with contextlib.suppress(CleanroomError, TimeoutError):
        argv = ["/bin/sh", "-c", SCRIPT]
        touched["sh"] = (await session.exec(argv, timeout_s=TIMEOUT_S)).exit_code
    with contextlib.suppress(CleanroomError, TimeoutError):
        await asyncio.wait_for(session.put(PUT, bytes(PUT_BYTES)), TIMEOUT_S)
        touched["put"] = PUT_BYTES
    with contextlib.suppress(CleanroomError, TimeoutError):
        touched["read"] = len(await asyncio.wait_for(session.get(READ), TIMEOUT_S))
    return touched
