"""Put the canary script (``canary.py``) into an env and run it: ``plant`` or ``probe``."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Any

from cleanroom.agent import wire
from cleanroom.drivers.base import Driver, Env
from cleanroom.errors import CheckError, ProtocolError
from cleanroom.isolation import canary as guest
from cleanroom.verify import guest_prefix

SCRIPT_PATH = "/run/cleanroom/isolation/canary.py"
CANARY_TIMEOUT_S = 180.0


def new_token() -> str:
    return "crcanary" + secrets.token_hex(8)


def canary_script() -> bytes:
    return Path(guest.__file__).read_bytes()


async def run_canary(driver: Driver, env: Env, command: str, token: str) -> dict[str, Any]:
    """PUT the canary script into ``env``, run ``plant`` or ``probe``, return its report."""
    prefix = guest_prefix(driver, env.env_id)
    path = prefix + SCRIPT_PATH
    await env.put(path, canary_script(), 0o755)
    python = sys.executable if prefix else "python3"  # no VM: the host's interpreter
    argv = [python, path, command, "--token", token, "--prefix", prefix]
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
