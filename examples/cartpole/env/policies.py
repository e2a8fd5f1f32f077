"""Deterministic, parameterized CartPole policies, chosen by a manifest's ``policy.id``.

Every policy is a function ``observation -> action`` (0 = push left, 1 = push right) built by
``make_policy(policy_id, params, seed)``. Same id, params and seed → same actions.

- ``random``: uniform coin flips from its own ``random.Random(seed + 1)`` (not the env's RNG).
  params: ``p_right`` (float in [0, 1], default 0.5).
- ``angle``: push toward the pole's lean: 1 if ``theta + k * theta_dot > 0``.
  params: ``k`` (float, default 0.5).
- ``linear``: a linear threshold over the observation: 1 if ``dot(w, obs) > 0``.
  params: ``w`` (four floats, default ``[0.0, 0.0, 1.0, 1.0]``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from typing import Any

Policy = Callable[[list[float]], int]

POLICY_IDS = ("random", "angle", "linear")


class PolicyError(ValueError):
    """An unknown policy id or bad policy parameters."""


def _number(params: Mapping[str, Any], name: str, default: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PolicyError(f"policy param {name!r} must be a finite number, got {value!r}")
    return float(value)


def _check_known(params: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(params) - known)
    if unknown:
        raise PolicyError(f"unknown policy params: {', '.join(unknown)}")


def random_policy(seed: int, p_right: float = 0.5) -> Policy:
    rng = random.Random(seed + 1)

    def act(obs: list[float]) -> int:
        return 1 if rng.random() < p_right else 0

    return act


def angle_policy(k: float = 0.5) -> Policy:
    def act(obs: list[float]) -> int:
        return 1 if obs[2] + k * obs[3] > 0 else 0

    return act


def linear_policy(w: tuple[float, float, float, float]) -> Policy:
    def act(obs: list[float]) -> int:
        return 1 if sum(wi * oi for wi, oi in zip(w, obs, strict=True)) > 0 else 0

    return act


def make_policy(policy_id: str, params: Mapping[str, Any] | None, seed: int) -> Policy:
    """Build the policy ``policy_id`` with ``params``; raise PolicyError when either is bad."""
    params = {} if params is None else params
    if not isinstance(params, Mapping):
        raise PolicyError(f"policy params must be an object, got {type(params).__name__}")
    if policy_id == "random":
        _check_known(params, {"p_right"})
        p_right = _number(params, "p_right", 0.5)
        if not 0.0 <= p_right <= 1.0:
            raise PolicyError(f"policy param 'p_right' must be in [0, 1], got {p_right}")
        return random_policy(seed, p_right)
    if policy_id == "angle":
        _check_known(params, {"k"})
        return angle_policy(_number(params, "k", 0.5))
    if policy_id == "linear":
        _check_known(params, {"w"})
        w = params.get("w", [0.0, 0.0, 1.0, 1.0])
        if not isinstance(w, list | tuple) or len(w) != 4:
            raise PolicyError(f"policy param 'w' must be a list of 4 numbers, got {w!r}")
        weights = tuple(_number({"w": v}, "w", 0.0) for v in w)
        return linear_policy((weights[0], weights[1], weights[2], weights[3]))
    raise PolicyError(f"unknown policy id {policy_id!r}; known: {', '.join(POLICY_IDS)}")
