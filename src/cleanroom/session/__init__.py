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
confirmed absent, one outcome on every path. Modules: ``opening`` (``session()``), ``core``
(``AsyncSession``), ``commands``, ``files``, ``transcript``, ``lifetime`` (the two clocks),
``guard`` (the gate every guest call passes), ``sync`` (``Session``), ``abandon`` (a session
dropped or left open at exit is destroyed, with a ``ResourceWarning``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from cleanroom.session.commands import CommandHandle, CommandResult
from cleanroom.session.core import AsyncSession
from cleanroom.session.opening import session
from cleanroom.session.sync import Session

__all__ = ["AsyncSession", "CommandHandle", "CommandResult", "Session", "session"]


class _CallableModule(types.ModuleType):
    """``cleanroom.session`` is both this package and the function: importing the package sets
    the attribute ``cleanroom.session`` to the module, so ``cr.session(...)`` must still work."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return session(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
