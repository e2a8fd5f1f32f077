"""Snapshot templates for the qemu driver: which one a request uses, and building it.

A template (files and checks: ``snapshot.py``) is built on first use by booting the baseline
once with its RAM in a file, preparing the agent (SNAPSHOT_PREPARE) and saving the VM; the build
VM is then destroyed and confirmed gone before the template is sealed. One build per key at a
time: an asyncio lock in this process, ``snapshot.build_lock`` across processes. A template
that drifted is discarded and rebuilt (with a note); after a failed build ``template_for``
refuses that key for ``TEMPLATE_RETRY_S`` (``auto`` then boots cold), and so it does after
``MAX_RESTORE_FAILURES`` clones of it failed to restore in a row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

from cleanroom import events
from cleanroom.agent.session import AgentSession
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers import hostproc, snapshot
from cleanroom.drivers.base import EnvRequest, new_env_id
from cleanroom.drivers.qemu.live import Live, first_line
from cleanroom.errors import CleanroomError, DriftError, DriverError, LaunchError

if TYPE_CHECKING:
    from cleanroom.drivers.qemu.driver import QemuDriver

MAX_RESTORE_FAILURES = 3  # clones of one template failing in a row: treat it as failed
TEMPLATE_RETRY_S = 300.0  # after a failed template build, cold boots until then (auto)


async def template_for(
    driver: QemuDriver, request: EnvRequest, accel: accel_mod.Accel
) -> tuple[snapshot.Template, str | None]:
    """The checked template for this request (built on first use), and a note if rebuilt."""
    key = driver.template_key(request, accel)
    failed = driver._template_failed.get(key)
    if failed is not None and time.monotonic() - failed[0] < TEMPLATE_RETRY_S:
        raise DriverError(failed[1])
    note: str | None = None
    async with driver._template_locks.setdefault(key, asyncio.Lock()):
        try:
            template = await asyncio.to_thread(snapshot.load, key)
        except DriftError as exc:
            note = f"template {key[:12]} was modified ({', '.join(exc.drifted)}); rebuilt"
            await asyncio.to_thread(snapshot.discard, key)
            template = None
        if template is not None:
            return template, note
        async with snapshot.build_lock(key, driver.boot_timeout_s + snapshot.SAVE_TIMEOUT_S):
            template = await asyncio.to_thread(snapshot.load, key)  # another process?
            if template is None:
                facts = {"baseline": request.baseline.name, "digest": request.baseline.digest}
                events.emit("template_building", key=key[:12], **facts)
                building = time.monotonic()
                try:
                    template = await driver._build_template(request, accel, key)
                except CleanroomError as exc:
                    why = f"template build failed: {first_line(exc)}"
                    driver._template_failed[key] = (time.monotonic(), why)
                    events.emit("template_failed", key=key[:12], error=why, **facts)
                    raise DriverError(why) from exc
                seconds = round(time.monotonic() - building, 3)
                events.emit("template_built", key=key[:12], seconds=seconds, **facts)
        return template, note


def count_restore_failure(
    driver: QemuDriver, request: EnvRequest, accel: accel_mod.Accel, exc: Exception
) -> None:
    """After MAX_RESTORE_FAILURES clones of a template failed in a row, stop using it
    for TEMPLATE_RETRY_S (auto: cold boots; a timed-out restore is expensive)."""
    if not isinstance(exc, LaunchError | OSError):
        return  # the template itself is missing or failed to build: already recorded
    key = driver.template_key(request, accel)
    failures = driver._restore_failures.get(key, 0) + 1
    driver._restore_failures[key] = failures
    if failures >= MAX_RESTORE_FAILURES:
        why = f"{failures} clones in a row failed to restore; last: {first_line(exc)}"
        driver._template_failed[key] = (time.monotonic(), why)
        driver._restore_failures[key] = 0


async def build_template(
    driver: QemuDriver, request: EnvRequest, accel: accel_mod.Accel, key: str
) -> snapshot.Template:
    """Boot the baseline with RAM in a file, prepare the agent, save, destroy the VM."""
    started = time.monotonic()
    build = dataclasses.replace(
        request,
        env_id=new_env_id(),
        hard_deadline_s=driver.boot_timeout_s + snapshot.SAVE_TIMEOUT_S + 60,
        labels={"purpose": "template", "template": key},
    )
    try:
        work = await asyncio.to_thread(snapshot.build_dir, key)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        state_fd = os.open(work / snapshot.STATE_FILE, flags, 0o600)
    except OSError as exc:
        raise DriverError(f"cannot prepare the template folder: {exc}") from exc
    memory = request.limits.memory_mib
    try:
        live = await driver._spawn(
            build,
            accel,
            snapshot.memory_args(work / snapshot.RAM_FILE, memory, shared=True),
            memory_backend=True,
        )
        writer, prepared = await _ready_template(live, driver.boot_timeout_s)
        try:
            save_s = await snapshot.save(await live.open_qmp(), state_fd)
        finally:
            writer.close()
        boot_s = time.monotonic() - started - save_s
    except BaseException as exc:
        await asyncio.shield(driver.destroy(build.env_id))
        await asyncio.to_thread(hostproc.remove_tree, work)
        if isinstance(exc, TimeoutError):
            raise DriverError(f"template VM not ready within {driver.boot_timeout_s:.0f}s") from exc
        if isinstance(exc, OSError):
            raise DriverError(f"template build failed: {exc}") from exc
        raise
    finally:
        os.close(state_fd)
    report = await driver.destroy(build.env_id)
    if not report.confirmed_absent:
        await asyncio.to_thread(hostproc.remove_tree, work)
        raise DriverError(f"template build VM {build.env_id} could not be confirmed gone")
    facts = {
        "baseline": request.baseline.digest,
        "qemu": accel.qemu_version,
        "accelerator": accel.name,
        "vcpus": request.limits.vcpus,
        "build_env": build.env_id,  # the build VM: destroyed and confirmed gone above
        "built_at": time.time(),
        "boot_s": round(boot_s, 3),
        "save_s": round(save_s, 3),
        **{k: v for k, v in prepared.items() if k in ("reseeder", "reseeder_note")},
    }
    try:
        return await asyncio.to_thread(snapshot.seal, work, key, memory, facts)
    except OSError as exc:
        await asyncio.to_thread(hostproc.remove_tree, work)
        raise DriverError(f"cannot save the template: {exc}") from exc


async def _ready_template(
    live: Live, timeout_s: float
) -> tuple[asyncio.StreamWriter, dict[str, Any]]:
    """Wait for the template VM's agent and tell it a snapshot follows (channel kept open);
    the agent's answer to that."""

    async def ready() -> tuple[asyncio.StreamWriter, dict[str, Any]]:
        reader, writer = await live.open_channel()
        session = AgentSession(reader, writer)
        await live.await_hello(session)  # closes the session if it fails
        try:
            if not snapshot.agent_supports_snapshots(session.hello):
                version = session.hello.get("agent_version")
                raise DriverError(f"the baseline's guest agent {version} predates snapshots")
            prepared = await snapshot.prepare(reader, writer)
        except BaseException:
            await session.aclose()
            raise
        return writer, prepared

    return await asyncio.wait_for(ready(), timeout_s)
