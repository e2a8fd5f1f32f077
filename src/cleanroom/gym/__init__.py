"""Gymnasium envs whose simulator runs in a fresh microVM per episode (``cleanroom[gym]``).

    import cleanroom.gym
    env = cleanroom.gym.make("CartPole-v1", baseline="examples/gym/baseline.toml")
    env = gymnasium.make("cleanroom/CartPole-v1", baseline=...)  # once cleanroom.gym is imported
    env = gymnasium.make("cleanroom.gym:cleanroom/CartPole-v1", baseline=...)  # no import needed

See ``env.CleanroomEnv``. Importing this package registers ``cleanroom/<id>`` for every id in
Gymnasium's registry at that moment (``registration.register_envs``).
"""

from __future__ import annotations

from typing import Any

from cleanroom.gym.env import CleanroomEnv
from cleanroom.gym.registration import NAMESPACE, check_kwargs, register_envs

__all__ = ["NAMESPACE", "CleanroomEnv", "make", "register_envs"]


def make(env: str, *, baseline: Any, **kwargs: Any) -> CleanroomEnv:
    """``CleanroomEnv(baseline, env=env, ...)``: the keyword arguments other than the
    ``CleanroomEnv`` ones (``driver``, ``store``, ``run_id``, ``step_timeout_s``, ``trajectory``,
    ``options``, ``lookahead``) go to the in-VM env (``env_kwargs``)."""
    own = {"driver", "store", "run_id", "step_timeout_s", "trajectory", "options", "lookahead"}
    env_kwargs = {k: v for k, v in kwargs.items() if k not in own}
    check_kwargs(env, env_kwargs)
    settings = {k: v for k, v in kwargs.items() if k in own}
    return CleanroomEnv(baseline, env=env, env_kwargs=env_kwargs, **settings)


register_envs()
