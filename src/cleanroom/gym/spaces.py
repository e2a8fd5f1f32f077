"""The spaces an in-VM env declared, kept per (baseline digest, env, kwargs) in the home.

A Gymnasium env must have its spaces before its first reset (``SyncVectorEnv`` and
``AsyncVectorEnv`` read them as they are built), and ours come from inside a VM: the first
look ever boots one (``CleanroomEnv._probe``), and this cache spares every later env of the
same pinned baseline that VM. What is stored is the guest's own description (a codec tree and
its bytes), read back through the same boundary (``wire.spaces_of``) as a live answer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import Any

from gymnasium import Space

from cleanroom.agent import gym_codec
from cleanroom.errors import ProtocolError
from cleanroom.gym import wire
from cleanroom.host import paths

Spaces = tuple[Space[Any], Space[Any]]


class SpaceCache:
    """One (baseline, env, kwargs)'s spaces: ``load`` (None if unknown), ``save``."""

    def __init__(self, digest: str, env: str, kwargs: dict[str, Any]) -> None:
        key = json.dumps([digest, env, kwargs], sort_keys=True, default=repr)
        name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".json"
        self.path = paths.home() / "gym" / "spaces" / name

    def load(self) -> Spaces | None:
        try:
            data = json.loads(self.path.read_text())
            made = gym_codec.decode(data["node"], base64.b64decode(data["body"]))
            observation, action, _ = wire.spaces_of(made)
        except (OSError, ValueError, KeyError, TypeError, ProtocolError):
            return None  # unknown or unreadable: learn them again
        return observation, action

    def save(self, made: Any) -> Spaces:
        """Check a GYM_SPACES answer's spaces, keep them, return them."""
        observation, action, _ = wire.spaces_of(made)
        keep = {k: made[k] for k in ("observation_space", "action_space")}
        node, body = gym_codec.encode(keep)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"node": node, "body": base64.b64encode(body).decode()}))
        os.replace(tmp, self.path)
        return observation, action
