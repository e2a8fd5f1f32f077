"""``cleanroom/<id>`` in Gymnasium's registry: ``gymnasium.make("cleanroom/CartPole-v1",
baseline=...)`` makes a ``CleanroomEnv`` of ``CartPole-v1``.

Gymnasium 1.x loads no plugins (its ``gymnasium.envs`` entry-point group went in 1.0: nothing
reads it), so the ids exist once ``cleanroom.gym`` is imported, or inside one call with
Gymnasium's own module prefix: ``gymnasium.make("cleanroom.gym:cleanroom/CartPole-v1", ...)``.
The ``gymnasium.envs`` entry point in ``pyproject.toml`` calls ``register_envs`` for the
Gymnasium 0.26-0.29 that still load plugins.
"""

from __future__ import annotations

from typing import Any

import gymnasium

NAMESPACE = "cleanroom"


def _make(**kwargs: Any) -> gymnasium.Env[Any, Any]:
    from cleanroom.gym import make

    env = kwargs.pop("env")
    return make(env, **kwargs)


def register_envs() -> list[str]:
    """Register ``cleanroom/<id>`` for every un-namespaced id registered now; returns them."""
    added = []
    for spec in list(gymnasium.registry.values()):
        if spec.namespace is not None:
            continue
        env_id = f"{NAMESPACE}/{spec.id}"
        if env_id not in gymnasium.registry:
            gymnasium.register(
                env_id,
                entry_point=_make,
                kwargs={"env": spec.id},
                disable_env_checker=True,  # the in-VM env is checked where it runs
                order_enforce=False,  # CleanroomEnv raises GymError for a step before reset
            )
            added.append(env_id)
    return added
