"""cleanroom: a fresh microVM per RL episode, durable evidence, and proven deletion."""

from __future__ import annotations

__version__ = "0.1.0"
