"""Snapshot templates for the qemu driver: which one a request uses, and building it.

A template (files and checks: ``snapshot.py``) is built on first use by booting the baseline
once with its RAM in a file, running the paths a session's first steps take (``touch.py``: the
guest's caches are then saved for every clone), preparing the agent (SNAPSHOT_PREPARE) and
saving the VM; the build VM is then destroyed and confirmed gone before the template is sealed.
One build per key at a time: an asyncio lock in this process, ``snapshot.build_lock`` across
processes. A template that drifted is discarded and rebuilt (with a note); after a failed build
``template_for`` refuses that key for ``TEMPLATE_RETRY_S`` (``auto`` then boots cold), and so it
does after ``MAX_RESTORE_FAILURES`` clones of it failed to restore in a row. ``Templates`` keeps
that state and asks its ``Builder`` (``TemplateBuilder``: a VM booted and saved) for a new
template.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any, Protocol

from cleanroom.agent import bulk
from cleanroom.agent.connection import AgentConnection
from cleanroom.core import events
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers import snapshot
from cleanroom.drivers.base import EnvRequest, new_env_id
from cleanroom.drivers.qemu import cmdline
from cleanroom.drivers.qemu.context import QemuContext
from cleanroom.drivers.qemu.live import Live, first_line
from cleanroom.drivers.qemu.touch import touch_guest_paths
from cleanroom.errors import CleanroomError, DriftError, DriverError, LaunchError
from cleanroom.host import hostproc

MAX_RESTORE_FAILURES = 3  # clones of one template failing in a row: treat it as failed
TEMPLATE_RETRY_S = 300.0  # after a failed template build, cold boots until then (auto)


class Builder(Protocol):
    async def build(
        self, request: EnvRequest, accel: accel_mod.Accel, key: str
    ) -> snapshot.Template: ...


class Templates:
    """Which template a request uses, built on first use; refused for a while after failing."""

    def __init__(self, ctx: QemuContext, builder: Builder | None = None) -> None:
        self.ctx = ctx
        self.builder: Builder = builder or TemplateBuilder(ctx)
        self._locks: dict[str, asyncio.Lock] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # key -> (when, why)
        self._restore_failures: dict[str, int] = {}  # key -> clones that failed in a row

    def key(self, request: EnvRequest, accel: accel_mod.Accel) -> str:
        # the bulk disk's size is its file's, not on the command line: a clone's is its template's
        machine = [*cmdline.machine_args(request, accel, memory_backend=True), f"bulk={bulk.SIZE}"]
        return snapshot.template_key(request.baseline, accel.qemu_version, accel.name, machine)

    async def template_for(
        self, request: EnvRequest, accel: accel_mod.Accel
    ) -> tuple[snapshot.Template, str | None]:
        """The checked template for this request (built on first use), and a note if rebuilt."""
        key = self.key(request, accel)
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < TEMPLATE_RETRY_S:
            raise DriverError(failed[1])
        note: str | None = None
        async with self._locks.setdefault(key, asyncio.Lock()):
            try:
                template = await asyncio.to_thread(snapshot.load, key)
            except DriftError as exc:
                note = f"template {key[:12]} was modified ({', '.join(exc.drifted)}); rebuilt"
                await asyncio.to_thread(snapshot.discard, key)
                template = None
            if template is not None:
                return template, note
            timeout_s = self.ctx.config.boot_timeout_s + snapshot.SAVE_TIMEOUT_S
            async with snapshot.build_lock(key, timeout_s):
                template = await asyncio.to_thread(snapshot.load, key)  # another process?
                if template is None:
                    template = await self._build(request, accel, key)
            return template, note

    async def _build(
        self, request: EnvRequest, accel: accel_mod.Accel, key: str
    ) -> snapshot.Template:
        facts = {"baseline": request.baseline.name, "digest": request.baseline.digest}
        events.emit("template_building", key=key[:12], **facts)
        building = time.monotonic()
        try:
            template = await self.builder.build(request, accel, key)
        except CleanroomError as exc:
            why = f"template build failed: {first_line(exc)}"
            self._failed[key] = (time.monotonic(), why)
            events.emit("template_failed", key=key[:12], error=why, **facts)
            raise DriverError(why) from exc
        seconds = round(time.monotonic() - building, 3)
        events.emit("template_built", key=key[:12], seconds=seconds, **facts)
        return template

    def restored(self, key: str) -> None:
        """A clone of the template ``key`` restored: its failures in a row start again at 0."""
        self._restore_failures.pop(key, None)

    def count_restore_failure(
        self, request: EnvRequest, accel: accel_mod.Accel, exc: Exception
    ) -> None:
        """After MAX_RESTORE_FAILURES clones of a template failed in a row, stop using it
        for TEMPLATE_RETRY_S (auto: cold boots; a timed-out restore is expensive)."""
        if not isinstance(exc, LaunchError | OSError):
            return  # the template itself is missing or failed to build: already recorded
        key = self.key(request, accel)
        failures = self._restore_failures.get(key, 0) + 1
        self._restore_failures[key] = failures
        if failures >= MAX_RESTORE_FAILURES:
            why = f"{failures} clones in a row failed to restore; last: {first_line(exc)}"
            self._failed[key] = (time.monotonic(), why)
            self._restore_failures[key] = 0


class TemplateBuilder:
    """Builds a template: the baseline booted with RAM in a file, prepared, saved, destroyed."""

    def __init__(self, ctx: QemuContext) -> None:
        self.ctx = ctx

    async def build(
        self, request: EnvRequest, accel: accel_mod.Accel, key: str
    ) -> snapshot.Template:
        """Boot the baseline with RAM in a file, prepare the agent, save, destroy the VM."""
        ctx, boot_timeout_s = self.ctx, self.ctx.config.boot_timeout_s
        started = time.monotonic()
        build = dataclasses.replace(
            request,
            env_id=new_env_id(),
            hard_deadline_s=boot_timeout_s + snapshot.SAVE_TIMEOUT_S + 60,
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
            live = await ctx.launcher.spawn(
                build,
                accel,
                snapshot.memory_args(work / snapshot.RAM_FILE, memory, shared=True),
                memory_backend=True,
            )
            session, prepared = await _ready_template(live, boot_timeout_s)
            try:
                save_s = await snapshot.save(await live.open_qmp(), state_fd)
            finally:
                await session.aclose()
            boot_s = time.monotonic() - started - save_s
        except BaseException as exc:
            await asyncio.shield(ctx.destroy(build.env_id))
            await asyncio.to_thread(hostproc.remove_tree, work)
            if isinstance(exc, TimeoutError):
                raise DriverError(f"template VM not ready within {boot_timeout_s:.0f}s") from exc
            if isinstance(exc, OSError):
                raise DriverError(f"template build failed: {exc}") from exc
            raise
        finally:
            os.close(state_fd)
        report = await ctx.destroy(build.env_id)
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
            **{k: v for k, v in prepared.items() if k in ("reseeder", "reseeder_note", "touched")},
        }
        try:
            return await asyncio.to_thread(snapshot.seal, work, key, memory, facts)
        except OSError as exc:
            await asyncio.to_thread(hostproc.remove_tree, work)
            raise DriverError(f"cannot save the template: {exc}") from exc


async def _ready_template(live: Live, timeout_s: float) -> tuple[AgentConnection, dict[str, Any]]:
    """Wait for the template VM's agent, touch the guest paths a session's first steps take and
    tell the agent a snapshot follows; the session (kept open until the save) and the agent's
    answer, with what was touched."""

    async def ready() -> tuple[AgentConnection, dict[str, Any]]:
        reader, writer = await live.open_channel()
        session = live.session_over(reader, writer)
        await live.await_hello(session)  # closes the session if it fails
        try:
            if not snapshot.agent_supports_snapshots(session.hello):
                version = session.hello.get("agent_version")
                raise DriverError(f"the baseline's guest agent {version} predates snapshots")
            touched = await touch_guest_paths(session)  # its caches saved for every clone
            prepared = {**await snapshot.prepare(session), "touched": touched}
        except BaseException:
            await session.aclose()
            raise
        return session, prepared

    return await asyncio.wait_for(ready(), timeout_s)
