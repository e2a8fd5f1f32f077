"""``cleanroom/<id>`` in Gymnasium's registry: ``gymnasium.make("cleanroom/CartPole-v1",
baseline=...)`` makes a ``CleanroomEnv`` of ``CartPole-v1``, wrapped as ``gymnasium.make``
wraps the native id: ``PassiveEnvChecker``, ``OrderEnforcing`` and ``TimeLimit`` with the
native spec's ``max_episode_steps`` (its ``reward_threshold`` and ``nondeterministic`` too).
The checker reads the spaces at ``make``: from the space cache, or one probe episode the first
time (``env.CleanroomEnv``). A keyword the native env's constructor does not take fails at
``make`` as it does for the native id (``check_kwargs``), before anything starts.

Gymnasium 1.x loads no plugins (its ``gymnasium.envs`` entry-point group went in 1.0: nothing
reads it), so the ids exist once ``cleanroom.gym`` is imported, or inside one call with
Gymnasium's own module prefix: ``gymnasium.make("cleanroom.gym:cleanroom/CartPole-v1", ...)``.
The ``gymnasium.envs`` entry point in ``pyproject.toml`` calls ``register_envs`` for the
Gymnasium 0.26-0.29 that still load plugins.
"""

from __future__ import annotations

import inspect
from typing import Any

import gymnasium

from cleanroom.errors import GymError

NAMESPACE = "cleanroom"


def _make(**kwargs: Any) -> gymnasium.Env[Any, Any]:
    from cleanroom.gym import make

    env = kwargs.pop("env")
    return make(env, **kwargs)


def check_kwargs(env: str, kwargs: dict[str, Any]) -> None:
    """Refuse keywords the native env of ``env`` (a registered id) cannot take, as its own
    ``gymnasium.make`` would (GymError naming them); an id not registered here, or a
    constructor taking ``**kwargs``, is left to the guest."""
    spec = gymnasium.registry.get(env)
    if spec is None or not kwargs or spec.entry_point is None:
        return
    try:
        creator = (
            spec.entry_point
            if callable(spec.entry_point)
            else gymnasium.envs.registration.load_env_creator(spec.entry_point)
        )
        params = inspect.signature(creator).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError, gymnasium.error.Error):
        return  # not importable on the host: the guest decides
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params}
    unknown = sorted(set(kwargs) - names - set(spec.kwargs))
    if unknown:
        raise GymError(
            f"{env}: unexpected keyword argument(s) {unknown} for {spec.entry_point} "
            f"(it takes {sorted(names)}): nothing was started"
        )


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
                max_episode_steps=spec.max_episode_steps,
                reward_threshold=spec.reward_threshold,
                nondeterministic=spec.nondeterministic,
            )
            added.append(env_id)
    return added
