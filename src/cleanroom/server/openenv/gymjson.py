"""Gymnasium values and spaces on OpenEnv's JSON wire.

``to_json``: an observation or an info dict as JSON (arrays as nested lists, numpy scalars as
numbers, tuples as lists, a non-finite float as null, anything else as its ``repr``).
``action_of``: a client's JSON action as a value of the action space, or ``ActionInvalid``
(OpenEnv's 422 / ``VALIDATION_ERROR``) saying why; nothing the space does not contain reaches
the in-VM env. ``schema_of``: a space as JSON schema (``/schema``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gymnasium import spaces

from cleanroom.server.control import ServerError

MAX_DEPTH = 16


class RequestInvalid(ServerError):
    """A reset or step body OpenEnv's server would refuse (422, ``VALIDATION_ERROR``)."""

    status = 422


class ActionInvalid(RequestInvalid):
    """An action that is not a value of the env's action space."""


def to_json(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON (see the module docstring)."""
    if depth > MAX_DEPTH:
        return repr(value)[:200]
    if isinstance(value, np.ndarray):
        return to_json(value.tolist(), depth + 1)
    if isinstance(value, np.generic):
        return to_json(value.item(), depth + 1)
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v, depth + 1) for v in value]
    return repr(value)[:2000]


def action_of(space: spaces.Space[Any], value: Any, where: str = "action") -> Any:
    """The client's JSON ``value`` as an element of ``space`` (``ActionInvalid`` if it is not)."""
    try:
        if isinstance(space, spaces.Discrete):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ActionInvalid(f"{where}: expected an integer, got {_kind(value)}")
            out: Any = np.int64(value)
        elif isinstance(space, spaces.Box | spaces.MultiDiscrete | spaces.MultiBinary):
            if _has_bool_or_text(value):
                raise ActionInvalid(f"{where}: expected numbers, got {_kind(value)}")
            array = np.asarray(value, dtype=space.dtype)
            if array.shape != space.shape:
                raise ActionInvalid(f"{where}: expected shape {list(space.shape or ())}")
            out = array
        elif isinstance(space, spaces.Dict):
            if not isinstance(value, dict) or set(value) != set(space.spaces):
                raise ActionInvalid(f"{where}: expected an object with {sorted(space.spaces)}")
            out = {k: action_of(s, value[k], f"{where}.{k}") for k, s in space.spaces.items()}
        elif isinstance(space, spaces.Tuple):
            if not isinstance(value, list) or len(value) != len(space.spaces):
                raise ActionInvalid(f"{where}: expected a list of {len(space.spaces)}")
            out = tuple(
                action_of(s, v, f"{where}[{i}]")
                for i, (s, v) in enumerate(zip(space.spaces, value, strict=True))
            )
        else:
            raise ActionInvalid(f"{where}: {type(space).__name__} actions are not supported")
    except (ValueError, TypeError, OverflowError) as exc:
        raise ActionInvalid(f"{where}: {exc}") from None
    if not space.contains(out):
        raise ActionInvalid(f"{where}: not in the action space {space}")
    return out


def _kind(value: Any) -> str:
    return type(value).__name__


def _has_bool_or_text(value: Any, depth: int = 0) -> bool:
    if depth > MAX_DEPTH or isinstance(value, bool | str | dict) or value is None:
        return True
    if isinstance(value, list):
        return any(_has_bool_or_text(v, depth + 1) for v in value)
    return False


def schema_of(space: spaces.Space[Any]) -> dict[str, Any]:
    """``space`` as JSON schema (Box bounds only where they are finite and uniform)."""
    if isinstance(space, spaces.Discrete):
        start = int(space.start)
        return {"type": "integer", "minimum": start, "maximum": start + int(space.n) - 1}
    if isinstance(space, spaces.Box | spaces.MultiDiscrete | spaces.MultiBinary):
        item: dict[str, Any] = {"type": "integer" if space.dtype.kind in "iub" else "number"}
        if isinstance(space, spaces.Box):
            low, high = np.unique(space.low), np.unique(space.high)
            if low.size == 1 and math.isfinite(float(low[0])):
                item["minimum"] = to_json(low[0])
            if high.size == 1 and math.isfinite(float(high[0])):
                item["maximum"] = to_json(high[0])
        elif isinstance(space, spaces.MultiBinary):
            item.update(minimum=0, maximum=1)
        schema = item
        for size in reversed(space.shape or ()):
            schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
        return schema
    if isinstance(space, spaces.Dict):
        props = {k: schema_of(s) for k, s in space.spaces.items()}
        return {
            "type": "object",
            "properties": props,
            "required": list(props),
            "additionalProperties": False,
        }
    if isinstance(space, spaces.Tuple):
        items = [schema_of(s) for s in space.spaces]
        return {
            "type": "array",
            "prefixItems": items,
            "minItems": len(items),
            "maxItems": len(items),
        }
    return {}


def schemas(obs_space: spaces.Space[Any], act_space: spaces.Space[Any]) -> dict[str, Any]:
    """OpenEnv's ``/schema`` body: the action, observation and state models as JSON schema."""
    action = {
        "title": "GymAction",
        "type": "object",
        "properties": {
            "action": schema_of(act_space),
            "metadata": {"type": "object", "title": "Metadata"},
        },
        "required": ["action"],
        "additionalProperties": False,
    }
    observation = {
        "title": "GymObservation",
        "type": "object",
        "properties": {
            "done": {"type": "boolean", "default": False},
            "reward": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None},
            "metadata": {"type": "object"},
            "obs": schema_of(obs_space),
            "info": {"type": "object"},
            "terminated": {"type": "boolean"},
            "truncated": {"type": "boolean"},
            "episode_id": {"type": "string"},
        },
        "required": ["obs", "info", "terminated", "truncated", "episode_id"],
        "additionalProperties": False,
    }
    state = {
        "title": "GymState",
        "type": "object",
        "properties": {
            "episode_id": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "step_count": {"type": "integer", "minimum": 0, "default": 0},
            "run_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "cleanroom_episode_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "episodes": {"type": "integer", "minimum": 0},
            "done": {"type": "boolean"},
            "env": {"type": "string"},
        },
        "additionalProperties": True,
    }
    return {"action": action, "observation": observation, "state": state}
