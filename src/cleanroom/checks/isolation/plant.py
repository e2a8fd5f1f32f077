"""Put the canary into an env and run it: ``plant`` or ``probe``.

The canary is ``canary.py`` run by the env's ``python3``, or, in an env whose guest agent is
the native one (an image that may have no Python at all), the static ``canary.c``
(``native_canary.py``): the same rows, the same report."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Any

from cleanroom.agent import wire
from cleanroom.checks.isolation import canary as guest
from cleanroom.checks.isolation.native_canary import canary_binary
from cleanroom.drivers.base import Driver, Env
from cleanroom.errors import CheckError, ProtocolError
from cleanroom.lifecycle.verify import guest_prefix

SCRIPT_PATH = "/run/cleanroom/isolation/canary.py"
BINARY_PATH = "/run/cleanroom/isolation/canary-{command}"
"""One file per command: plant's lingering child still runs its binary (a PUT over it: ETXTBSY)."""
CANARY_TIMEOUT_S = 180.0


def new_token() -> str:
    return "crcanary" + secrets.token_hex(8)


def canary_script() -> bytes:
    return Path(guest.__file__).read_bytes()


def canary_kind(env: Env) -> str:
    """``native`` for an env run by the native agent (no Python assumed), else ``python``."""
    return "native" if env.hello.get("agent") == "native" else "python"


async def run_canary(
    driver: Driver, env: Env, command: str, token: str, kind: str | None = None
) -> dict[str, Any]:
    """PUT the canary into ``env``, run ``plant`` or ``probe``, return its report (``kind``:
    ``python`` or ``native``; by default ``canary_kind(env)``)."""
    prefix = guest_prefix(driver, env.env_id)
    if (kind or canary_kind(env)) == "native":
        path = prefix + BINARY_PATH.format(command=command)
        await env.put(path, canary_binary().read_bytes(), 0o755)
        argv = [path]
    else:
        path = prefix + SCRIPT_PATH
        await env.put(path, canary_script(), 0o755)
        argv = [sys.executable if prefix else "python3", path]  # no VM: the host's interpreter
    argv += [command, "--token", token, "--prefix", prefix]
    result = await env.exec(argv, timeout_s=CANARY_TIMEOUT_S)
    if not result.ok:
        tail = result.stderr[-400:].decode(errors="replace")
        raise CheckError(
            f"canary {command} failed in {env.env_id} (exit {result.exit_code}): {tail}"
        )
    try:  # the canary runs in the guest: its output crosses the host's boundary for guest bytes
        data = wire.decode_json(result.stdout, wire.JsonLimits(len(result.stdout)), "canary")
    except ProtocolError as exc:
        raise CheckError(f"canary {command} in {env.env_id} printed no JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckError(f"canary {command} in {env.env_id} printed no JSON object")
    return data
