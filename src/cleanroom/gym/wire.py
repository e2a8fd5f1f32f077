"""The host's boundary for what the in-VM Gymnasium env sends: values, spaces, step answers.

A GYM_* answer is a ``gym_codec`` tree (header ``tree``) and its raw bytes; ``value`` decodes it
with the codec's limits (dtype allowlist, dimensions, node count, exact body length) and maps
every refusal onto ``ProtocolError``. ``space`` builds a Gymnasium space from the guest's
description (Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple) and refuses anything else
or inconsistent (``low`` and ``high`` of different shapes, ``n`` < 1, a space of more than
``MAX_SPACE_ELEMENTS`` values). ``step``/``reset`` check an answer's shape and make its reward a
finite float, so nothing the guest sends can crash the loop or put a NaN into a record.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gymnasium import spaces

from cleanroom.agent import gym_codec
from cleanroom.agent.protocol import Frame, Kind
from cleanroom.errors import GymEnvError, ProtocolError

MAX_SPACE_ELEMENTS = 1 << 22  # values of one Box / MultiDiscrete (a 2048x2048 image)
MAX_DISCRETE = 1 << 62


def value(frame: Frame, expected: int) -> Any:
    """The decoded value of an answer of kind ``expected`` (GYM_ERROR: ``GymEnvError``)."""
    if frame.kind == Kind.GYM_ERROR:
        message = frame.header.get("message")
        text = message[-2000:] if isinstance(message, str) else "the gym process failed"
        raise GymEnvError(f"in-VM env: {text}")
    if frame.kind != expected:
        raise ProtocolError(f"expected frame {expected}, got {frame.kind}")
    try:
        return gym_codec.decode(frame.header.get("tree"), frame.body)
    except (gym_codec.BadTree, ValueError, TypeError) as exc:
        raise ProtocolError(f"gym answer: {exc}") from None


def _dict(item: Any, what: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ProtocolError(f"{what} is not a mapping")
    return item


def _int(item: Any, what: str, low: int = 0, high: int = MAX_DISCRETE) -> int:
    if isinstance(item, np.integer):
        item = int(item)
    if not isinstance(item, int) or isinstance(item, bool) or not low <= item <= high:
        raise ProtocolError(f"{what} is not an int in [{low}, {high}]")
    return item


def _array(item: Any, what: str, kinds: str) -> np.ndarray[Any, Any]:
    if not isinstance(item, np.ndarray) or item.dtype.kind not in kinds:
        raise ProtocolError(f"{what} is not an array of kind {kinds!r}")
    if item.size > MAX_SPACE_ELEMENTS:
        raise ProtocolError(f"{what} has more than {MAX_SPACE_ELEMENTS} values")
    return item


def space(item: Any, depth: int = 0) -> spaces.Space[Any]:
    """A Gymnasium space from the guest's description (``gym_worker.space_value``)."""
    desc = _dict(item, "a space")
    kind = desc.get("kind")
    if depth > 8:
        raise ProtocolError("spaces nested deeper than 8")
    try:
        if kind == "Box":
            low = _array(desc.get("low"), "Box.low", "biuf")
            high = _array(desc.get("high"), "Box.high", "biuf")
            if low.shape != high.shape or low.dtype != high.dtype:
                raise ProtocolError("Box.low and Box.high differ in shape or dtype")
            return spaces.Box(low=low, high=high, dtype=low.dtype)
        if kind == "Discrete":
            return spaces.Discrete(
                _int(desc.get("n"), "Discrete.n", 1),
                start=_int(desc.get("start"), "Discrete.start", -MAX_DISCRETE),
            )
        if kind == "MultiDiscrete":
            nvec = _array(desc.get("nvec"), "MultiDiscrete.nvec", "iu")
            start = _array(desc.get("start"), "MultiDiscrete.start", "iu")
            if nvec.shape != start.shape or (nvec.size and nvec.min() < 1):
                raise ProtocolError("MultiDiscrete: nvec < 1 or start of another shape")
            return spaces.MultiDiscrete(nvec, dtype=nvec.dtype, start=start)
        if kind == "MultiBinary":
            n = desc.get("n")
            dims = (
                [_int(d, "MultiBinary.n", 1, MAX_SPACE_ELEMENTS) for d in n]
                if isinstance(n, list)
                else [_int(n, "MultiBinary.n", 1, MAX_SPACE_ELEMENTS)]
            )
            if math.prod(dims) > MAX_SPACE_ELEMENTS or not dims:
                raise ProtocolError("MultiBinary: too many values")
            return spaces.MultiBinary(dims if isinstance(n, list) else dims[0])
        if kind == "Dict":
            inner = _dict(desc.get("spaces"), "Dict.spaces")
            return spaces.Dict({k: space(v, depth + 1) for k, v in inner.items()})
        if kind == "Tuple":
            items = desc.get("spaces")
            if not isinstance(items, tuple):
                raise ProtocolError("Tuple.spaces is not a tuple")
            return spaces.Tuple([space(v, depth + 1) for v in items])
    except ProtocolError:
        raise
    except (ValueError, TypeError, OverflowError, AssertionError) as exc:  # gymnasium's checks
        raise ProtocolError(f"{kind} space: {type(exc).__name__}: {exc}") from None
    raise ProtocolError(f"space kind {str(kind)[:40]!r} is not supported")


def spaces_of(answer: Any) -> tuple[spaces.Space[Any], spaces.Space[Any], dict[str, Any]]:
    """(observation space, action space, facts) from a GYM_SPACES answer."""
    desc = _dict(answer, "GYM_SPACES")
    facts = {k: desc.get(k) for k in ("spec_id", "premade", "versions")}
    return space(desc.get("observation_space")), space(desc.get("action_space")), facts


def reset(answer: Any) -> tuple[Any, dict[str, Any]]:
    """(obs, info) of a GYM_RESET answer (a frame after them: ``frame``)."""
    if not (isinstance(answer, tuple) and len(answer) in (2, 3)):
        raise ProtocolError("a reset answer is not (obs, info) or (obs, info, frame)")
    return answer[0], _dict(answer[1], "info")


def frame(answer: Any) -> np.ndarray[Any, Any] | None:
    """The rendered frame of a GYM_RESET/STEP answer (an (H, W, 3) uint8 array), if any."""
    if not (isinstance(answer, tuple) and len(answer) == 3) or answer[2] is None:
        return None
    image = answer[2]
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise ProtocolError("a frame is not a uint8 array")
    if image.ndim != 3 or image.shape[2] not in (3, 4):
        raise ProtocolError(f"a frame of shape {image.shape} is not an RGB image")
    return image


def step(frame: Frame, answer: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
    """(obs, reward, terminated, truncated, info) of a GYM_STEP answer: the flags come in
    the frame's header (``r``, ``te``, ``tr``: JSON, finite by ``wire.decode_header``)."""
    obs, info = reset(answer)
    reward, terminated, truncated = (frame.header.get(k) for k in ("r", "te", "tr"))
    if isinstance(reward, int) and not isinstance(reward, bool):
        reward = float(reward)
    if not isinstance(reward, float) or not math.isfinite(reward):
        raise ProtocolError("step: the reward is not a finite number")
    if not isinstance(terminated, bool) or not isinstance(truncated, bool):
        raise ProtocolError("step: terminated/truncated are not bools")
    return obs, reward, terminated, truncated, info
