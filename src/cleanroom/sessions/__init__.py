"""Interactive sessions: an ``Episode`` whose RUN phase is commands and files sent from outside.

    import cleanroom as cr
    async with cr.session(baseline="examples/agent-repair/baseline.toml", seed=3,
                          timeout_s=900, idle_timeout_s=120, secrets=["HF_TOKEN"]) as sb:
        r = await sb.commands.run("pytest -q", cwd="/repo", timeout=60)   # CommandResult
        await sb.files.write("/repo/fix.py", b"...");  data = await sb.files.read("/repo/x")
        sb.finish(reward=1.0, info={...}, artifacts=["/repo/patch.diff"])

    with cr.Session(baseline=..., seed=3) as sb:         # the same, blocking, from any thread
        sb.commands.run("make").check()

A session keeps every lifecycle guarantee of a batch episode (``opening``): intent row first,
the transcript (``transcript``) and the artifacts durable before the VM is destroyed and
confirmed absent, one outcome on every path. Modules, bottom first: ``transcript``, ``guard``
(the gate every guest call passes), ``commands``, ``files``, ``lifetime`` (the two clocks),
``core`` (``AsyncSession``; it forks through a ``Forker`` it is given, never importing
``fork``), ``interact`` (a session's block: whatever ends it, it concludes, is exported and
destroyed; a session dropped or left open at exit too, with a ``ResourceWarning``), ``fork``
(branches of a live session), ``pause`` (a session saved as a snapshot, resumed later),
``opening`` (``session()``), ``sync`` (``Session``).
"""

from __future__ import annotations

from cleanroom.sessions.commands import CommandHandle, CommandResult
from cleanroom.sessions.core import AsyncSession
from cleanroom.sessions.opening import session
from cleanroom.sessions.sync import Session

__all__ = ["AsyncSession", "CommandHandle", "CommandResult", "Session", "session"]
