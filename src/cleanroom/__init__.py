"""cleanroom: a fresh microVM per RL episode, durable evidence, and proven deletion.

    import cleanroom
    result = cleanroom.run([{"episode_id": "a", "seed": 1, "policy": {"id": "p"}}],
                           baseline="examples/cartpole/baseline.toml")
    print(result.rewards())

The names below load on first use, so ``import cleanroom`` stays cheap.
"""

from __future__ import annotations

from typing import Any

from cleanroom.core.version import __version__

__all__ = [
    "AsyncSession",
    "CommandResult",
    "Manifest",
    "RayCluster",
    "RunOptions",
    "RunResult",
    "Session",
    "__version__",
    "arun",
    "group",
    "open_env",
    "run",
    "session",
]

_LAZY = {
    "run": "cleanroom.api",
    "arun": "cleanroom.api",
    "group": "cleanroom.api",
    "open_env": "cleanroom.api",
    "Manifest": "cleanroom.evidence.manifest",
    "RunOptions": "cleanroom.lifecycle.context",
    "RunResult": "cleanroom.batch.result",
    "session": "cleanroom.sessions",
    "Session": "cleanroom.sessions",
    "AsyncSession": "cleanroom.sessions",
    "CommandResult": "cleanroom.sessions",
    "RayCluster": "cleanroom.integrations.ray.config",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'cleanroom' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
