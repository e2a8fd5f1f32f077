"""Destroy an env and prove it: retries within the cleanup window, ledger rows, an alert if it
remains, and the proof (``destroy.json``) in the episode's store folder. Also the end of a
run's spares (envs started ahead that no episode took)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from typing import TYPE_CHECKING

from cleanroom.drivers.base import DestroyReport, Env
from cleanroom.errors import CleanroomError, StoreError

if TYPE_CHECKING:
    from cleanroom.batch.runner import Controller


async def destroy_env(
    ctl: Controller,
    env: Env | None,
    env_id: str,
    run_id: str,
    eid: str | None,
    attempt: int | None,
) -> DestroyReport:
    """Destroy with retries inside the cleanup window; alert if anything remains.

    The proof goes to the episode's ``attempts/<n>/destroy.json`` (a group's warm parent,
    ``eid`` None, has only its ledger row)."""
    ctl.ledger.env_destroy_started(env_id)
    start = time.monotonic()
    attempts, delay = 0, 0.05
    report = DestroyReport(env_id, False, 0, 0.0, "not attempted")
    while time.monotonic() - start < ctl.options.cleanup_window_s:
        attempts += 1
        try:
            remaining = ctl.options.cleanup_window_s - (time.monotonic() - start)
            coro = env.aclose() if env is not None and attempts == 1 else ctl.driver.destroy(env_id)
            report = await asyncio.wait_for(coro, max(remaining, 0.1))
        except (TimeoutError, CleanroomError, OSError) as exc:
            report = DestroyReport(env_id, False, attempts, 0.0, f"{type(exc).__name__}: {exc}")
        if report.confirmed_absent:
            break
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)
    elapsed_ms = (time.monotonic() - start) * 1000
    report = DestroyReport(env_id, report.confirmed_absent, attempts, elapsed_ms, report.detail)
    ctl.ledger.env_destroyed(
        env_id,
        confirmed_absent=report.confirmed_absent,
        cleanup_ms=elapsed_ms,
        attempts=attempts,
    )
    if not report.confirmed_absent:
        ctl.ledger.event(
            "env_leaked", run_id=run_id, episode_id=eid, env_id=env_id, detail=report.detail
        )
        ctl._emit(
            "alert",
            message=f"env {env_id} still present after cleanup window",
            env_id=env_id,
            episode_id=eid,
        )
    if eid is not None:
        with contextlib.suppress(StoreError):
            await asyncio.to_thread(
                ctl.store.put_bytes,
                run_id,
                eid,
                f"attempts/{attempt}/destroy.json",
                _destroy_json(report),
            )
    return report


async def release_spares(ctl: Controller, run_id: str) -> list[str]:
    """Destroy the envs the driver started ahead that no episode took, record each
    (``spare_destroyed``, or ``env_leaked`` and an alert); the ids of those that remain."""
    leaked = []
    for report in await ctl.driver.release_spares():
        kind = "spare_destroyed" if report.confirmed_absent else "env_leaked"
        ctl.ledger.event(kind, run_id=run_id, env_id=report.env_id, cleanup_ms=report.elapsed_ms)
        if not report.confirmed_absent:
            leaked.append(report.env_id)
            message = f"spare env {report.env_id} still present"
            ctl._emit("alert", message=message, env_id=report.env_id)
    return leaked


def _destroy_json(report: DestroyReport) -> bytes:
    return json.dumps(
        {
            "env_id": report.env_id,
            "confirmed_absent": report.confirmed_absent,
            "attempts": report.attempts,
            "cleanup_ms": round(report.elapsed_ms, 3),
            "detail": report.detail,
            "pid": os.getpid(),
        },
        indent=1,
    ).encode()
