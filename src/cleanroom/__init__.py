"""cleanroom: a fresh microVM per RL episode, durable evidence, and proven deletion."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {  # public names, imported on first use (``import cleanroom`` stays light, Ray-free)
    "run": "cleanroom.api",
    "arun": "cleanroom.api",
    "group": "cleanroom.api",
    "RayCluster": "cleanroom.integrations.ray.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cleanroom' has no attribute {name!r}")
