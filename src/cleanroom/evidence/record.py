"""Outcomes, the guest's result.json, and the durable result record.

An episode ends with exactly one ``Outcome``. Only *final* outcomes (the episode itself decided
them: completed, episode_error, timeout) produce a ``result.json`` in the store; the others
(cancelled, env_crashed, infra_error, export_failed) are recorded in the ledger with their
diagnostics under ``attempts/<n>/`` and are run again when the run is resumed. ``superseded``:
another attempt of the same episode (a retry on another node) was durable first; this attempt
wrote no record and replaced none of the winner's files.
"""

from __future__ import annotations

import math
import platform
import socket
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from cleanroom.agent import wire
from cleanroom.agent.protocol import RESULT_MAX_BYTES
from cleanroom.errors import ProtocolError


@dataclass(frozen=True)
class GuestResult:
    """The parsed /run/cleanroom/result.json (or why it could not be used)."""

    reward: float | None
    terminated: bool | None
    truncated: bool | None
    info: dict[str, Any]
    metrics: dict[str, Any]
    problem: str | None  # None when the file was present and valid


def parse_guest_result(raw: bytes | None) -> GuestResult:
    """Validate what the entrypoint wrote; never raises (the guest is untrusted).

    The JSON goes through the host's boundary (``wire.decode_json``): bounded depth, size and
    item count, finite numbers, valid strings; anything else is the ``problem``."""

    def bad(problem: str) -> GuestResult:
        return GuestResult(None, None, None, {}, {}, problem)

    if raw is None:
        return bad("the entrypoint wrote no /run/cleanroom/result.json")
    if len(raw) > RESULT_MAX_BYTES:
        return bad(f"result.json is larger than {RESULT_MAX_BYTES} bytes")
    try:
        data = wire.decode_json(raw, wire.RESULT, "result.json")
    except ProtocolError as exc:
        return bad(str(exc))
    if not isinstance(data, dict):
        return bad("result.json must hold a JSON object")
    reward = data.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return bad("result.json: 'reward' must be a finite number")
    info = data.get("info", {})
    metrics = data.get("metrics", {})
    return GuestResult(
        reward=float(reward),
        terminated=data.get("terminated") if isinstance(data.get("terminated"), bool) else None,
        truncated=data.get("truncated") if isinstance(data.get("truncated"), bool) else None,
        info=info if isinstance(info, dict) else {"value": info},
        metrics=metrics if isinstance(metrics, dict) else {"value": metrics},
        problem=None,
    )


@cache
def cleanroom_revision() -> str:
    """The git revision of this checkout, or "unknown" for an installed package."""
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


@cache
def host_facts() -> dict[str, str]:
    return {"hostname": socket.gethostname(), "kernel": platform.release()}
