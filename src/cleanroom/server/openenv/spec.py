"""``--openenv NAME=ENV@TEMPLATE``: which Gym env a served OpenEnv name is, in which baseline."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cleanroom.errors import ConfigError

NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class OpenEnvSpec:
    """A served OpenEnv environment: its route name, the Gym env, its template, its kwargs."""

    name: str
    env: str
    template: str
    kwargs: dict[str, Any] = field(default_factory=dict)


def parse_specs(given: Iterable[str], templates: Iterable[str]) -> dict[str, OpenEnvSpec]:
    """``NAME=ENV@TEMPLATE[#JSON]`` items (``#JSON``: the env's keyword arguments as a JSON
    object) by name; a template that is not served, a bad name or a repeated one is a
    ``ConfigError`` naming the item."""
    known = set(templates)
    out: dict[str, OpenEnvSpec] = {}
    for item in given:
        name, sep, rest = item.partition("=")
        rest, _, raw_kwargs = rest.partition("#")
        env, at, template = rest.rpartition("@")
        if not sep or not at or not env or not template:
            raise ConfigError(f"--openenv {item!r}: expected NAME=ENV@TEMPLATE")
        if not NAME.match(name):
            raise ConfigError(f"--openenv {item!r}: a name is [a-z0-9_.-], 1-63 characters")
        if name in out:
            raise ConfigError(f"--openenv {item!r}: {name!r} is named twice")
        if template not in known:
            raise ConfigError(
                f"--openenv {item!r}: no template {template!r} (--template NAME=BASELINE)"
            )
        kwargs: Any = {}
        if raw_kwargs:
            try:
                kwargs = json.loads(raw_kwargs)
            except ValueError as exc:
                raise ConfigError(f"--openenv {item!r}: the kwargs are not JSON: {exc}") from exc
            if not isinstance(kwargs, dict):
                raise ConfigError(f"--openenv {item!r}: the kwargs are not a JSON object")
        out[name] = OpenEnvSpec(name, env, template, kwargs)
    return out
