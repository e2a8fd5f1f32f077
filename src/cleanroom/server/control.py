"""E2B's control API on top of sessions: every sandbox is one ``cleanroom.session``.

``Sandboxes`` owns the server's sandboxes as ``batch/`` owns episodes: each lives in a task of
its own that holds ``session(...)`` open (ledger intent first, a run of its own named
``serve-<sandbox id>``, the sandbox id as its episode id) until it ends:

- ``kill``: the session is finished (``completed``, ``info.ended = "killed"``); ``kill``
  returns only once the session block has closed: record durable, env destroyed and confirmed
  absent;
- its timeout (E2B's ``timeout``, moved by ``set_timeout``): ``timeout``, with its record;
- server shutdown (``close``): every task cancelled: ``cancelled``, durable, destroyed;
- its guest failing a call (the agent died: ``env_crashed``; broke the protocol:
  ``episode_error``): the session ends with the guest's outcome; other sandboxes go on.

The E2B timeout is the session's own ``timeout_s`` clock (``Lifetime``), moved to the
sandbox's deadline; the session is opened with ``max_lifetime_s`` as its manifest timeout, so
the deadman that ends a VM whose server died sits at that bound. A key sees only its own
sandboxes: another key's id is ``SandboxNotFound`` exactly like an unknown one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cleanroom.baseline.model import Baseline
from cleanroom.drivers.base import Driver, Owner
from cleanroom.errors import CleanroomError, SessionTimeout
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import AsyncSession, CommandHandle, session

ENVD_VERSION = "0.5.7"  # what the SDK may use: stdin, default user, octet-stream uploads
DEFAULT_TIMEOUT_S = 300
GUEST_CHECK_S = 0.5  # how often a sandbox looks whether a call found its guest failed


class ServerError(CleanroomError):
    """A request the server refuses; ``status`` is its HTTP status."""

    status = 400


class SandboxNotFound(ServerError):
    status = 404


class TemplateNotFound(ServerError):
    status = 404


class LimitReached(ServerError):
    """A concurrency or rate limit: 429 with ``Retry-After``."""

    status = 429

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Process:
    """A command started through envd: its handle and everyone streaming its events."""

    pid: int
    handle: CommandHandle
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    listeners: list[asyncio.Queue[tuple[str, Any]]] = field(default_factory=list)
    result: Any = None  # its CommandResult once it ended
    terminal: Any = None  # the GuestProcess of a PTY process (resize), else None

    def emit(self, kind: str, data: Any) -> None:
        for q in list(self.listeners):
            q.put_nowait((kind, data))


@dataclass
class Sandbox:
    """One served sandbox: who owns it, what E2B reports of it, its session while it lives."""

    sandbox_id: str
    key_id: str
    template: str
    baseline: Baseline
    metadata: dict[str, str]
    envs: dict[str, str]
    access_token: str
    timeout_s: float
    network: list[str] | None
    started_at: float = field(default_factory=time.time)
    end_at: float = 0.0
    sb: AsyncSession | None = None
    task: asyncio.Task[None] | None = None
    ready: asyncio.Future[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ended: str | None = None  # why it ended (once it has)
    processes: dict[int, Process] = field(default_factory=dict)
    next_pid: int = 1000
    traffic_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # its ports

    @property
    def live(self) -> bool:
        return self.ended is None and self.sb is not None

    def new_pid(self) -> int:
        self.next_pid += 1
        return self.next_pid


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


@dataclass
class ServerConfig:
    """What ``cleanroom serve`` was started with."""

    templates: dict[str, Callable[[], Baseline]]
    driver: Driver
    max_sandboxes: int = 64
    max_lifetime_s: float = 24 * 3600
    options: RunOptions = field(default_factory=lambda: RunOptions(spares=0))
    domain: str | None = None


class Sandboxes:
    """The server's registry: sandbox id -> ``Sandbox`` (see the module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.by_id: dict[str, Sandbox] = {}
        self.owner = Owner("serve-" + secrets.token_hex(6))
        self.closing = False
        self.ended: Counter[str] = Counter()  # sandboxes ended, by why
        self._baselines: dict[str, Baseline] = {}
        self._resolving = asyncio.Lock()

    # -- lookup -----------------------------------------------------------------------------

    def get(self, key_id: str, sandbox_id: str) -> Sandbox:
        """The live sandbox ``sandbox_id`` of ``key_id`` (anything else: ``SandboxNotFound``)."""
        sbx = self.by_id.get(sandbox_id)
        if sbx is None or sbx.key_id != key_id or not sbx.live:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return sbx

    def of_key(self, key_id: str) -> list[Sandbox]:
        return [s for s in self.by_id.values() if s.key_id == key_id and s.live]

    def baseline(self, template: str) -> Baseline:
        """The baseline ``template`` names (resolved once, built if its spec was not yet)."""
        if template not in self._baselines:
            make = self.config.templates.get(template)
            if make is None:
                raise TemplateNotFound(f"template '{template}' not found")
            self._baselines[template] = make()
        return self._baselines[template]

    # -- create -----------------------------------------------------------------------------

    async def create(
        self,
        key_id: str,
        template: str,
        *,
        timeout_s: float | None,
        metadata: dict[str, str],
        envs: dict[str, str],
        network: list[str] | None,
        max_per_key: int,
    ) -> Sandbox:
        """A new live sandbox (its env ready); ``LimitReached`` over a limit."""
        if self.closing:
            raise LimitReached("the server is shutting down", 5.0)
        if template not in self._baselines:  # one build of a template at a time
            async with self._resolving:
                await asyncio.to_thread(self.baseline, template)
        baseline = self.baseline(template)
        if len(self.of_key(key_id)) >= max_per_key:
            raise LimitReached(f"at most {max_per_key} sandboxes per key at once", 1.0)
        live = sum(1 for s in self.by_id.values() if s.ended is None)
        if live >= self.config.max_sandboxes:
            raise LimitReached(f"at most {self.config.max_sandboxes} sandboxes at once", 1.0)
        timeout = float(timeout_s or DEFAULT_TIMEOUT_S)
        timeout = max(1.0, min(timeout, self.config.max_lifetime_s))
        sbx = Sandbox(
            sandbox_id="i" + secrets.token_hex(10),
            key_id=key_id,
            template=template,
            baseline=baseline,
            metadata=dict(metadata),
            envs=dict(envs),
            access_token=secrets.token_urlsafe(24),
            timeout_s=timeout,
            network=network,
        )
        loop = asyncio.get_running_loop()
        sbx.ready = loop.create_future()
        self.by_id[sbx.sandbox_id] = sbx
        sbx.task = loop.create_task(self._life(sbx), name=f"sandbox {sbx.sandbox_id}")
        try:
            await asyncio.shield(sbx.ready)
        except asyncio.CancelledError:
            sbx.stop.set()  # the client went away before it was ready: nobody can use it
            raise
        return sbx

    async def _life(self, sbx: Sandbox) -> None:
        assert sbx.ready is not None
        try:
            async with session(
                sbx.baseline,
                driver=self.config.driver,
                episode_id=sbx.sandbox_id,
                run_id=f"serve-{sbx.sandbox_id}",
                options=self.config.options,
                timeout_s=self.config.max_lifetime_s,
                network=sbx.network,
                task={"template": sbx.template, "metadata": sbx.metadata, "served": True},
                owner=self.owner,
            ) as sb:
                sbx.sb = sb
                self._deadline(sbx, sbx.timeout_s)
                sbx.ready.set_result(None)
                while not sbx.stop.is_set():
                    if sb.guard.failed_by is not None:  # the guest broke or died in a call
                        raise sb.guard.failed_by  # its outcome (``interact``), its record
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sbx.stop.wait(), GUEST_CHECK_S)
                sbx.ended = "killed"
                sb.finish(0.0, info={"ended": "killed", "sandbox_id": sbx.sandbox_id})
        except SessionTimeout:
            sbx.ended = "timeout"
        except asyncio.CancelledError:
            sbx.ended = sbx.ended or "cancelled"
            raise
        except BaseException as exc:
            sbx.ended = sbx.ended or f"failed: {type(exc).__name__}"
            if not sbx.ready.done():
                sbx.ready.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            sbx.ended = sbx.ended or "closed"
            self.ended[sbx.ended.split(":")[0]] += 1
            if not sbx.ready.done():
                sbx.ready.set_exception(ServerError(f"sandbox {sbx.sandbox_id} ended at start"))
            for proc in sbx.processes.values():
                proc.emit("gone", None)
            self.by_id.pop(sbx.sandbox_id, None)

    # -- timeout ----------------------------------------------------------------------------

    def _deadline(self, sbx: Sandbox, seconds: float) -> None:
        """End the sandbox ``seconds`` from now (``timeout``): its session's own clock, moved."""
        assert sbx.sb is not None
        life = sbx.sb.guard.lifetime
        if life is None:
            return
        seconds = max(0.0, min(seconds, self.config.max_lifetime_s))
        loop = asyncio.get_running_loop()
        started = loop.time() - (time.time() - sbx.started_at)
        life.deadline = loop.time() + seconds
        life.timeout_s = max(1.0, life.deadline - started)
        life.busy()  # re-arms its timer at the new deadline (and leaves it idle as it was)
        life.idle()
        sbx.end_at = time.time() + seconds

    def set_timeout(self, key_id: str, sandbox_id: str, seconds: float) -> None:
        self._deadline(self.get(key_id, sandbox_id), seconds)

    # -- end --------------------------------------------------------------------------------

    async def kill(self, key_id: str, sandbox_id: str) -> None:
        """End the sandbox; returns once its session closed (env destroyed, confirmed)."""
        sbx = self.get(key_id, sandbox_id)
        sbx.stop.set()
        assert sbx.task is not None
        with contextlib.suppress(Exception):
            await asyncio.shield(sbx.task)

    async def close(self, grace_s: float = 120.0) -> None:
        """Server shutdown: every sandbox ends ``cancelled``, durable, destroyed, confirmed."""
        self.closing = True
        tasks = [s.task for s in self.by_id.values() if s.task is not None]
        for t in tasks:
            t.cancel("cleanroom serve is shutting down")
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)

    # -- views ------------------------------------------------------------------------------

    def created(self, sbx: Sandbox) -> dict[str, Any]:
        """The ``Sandbox`` body of create / connect."""
        return {
            "templateID": sbx.template,
            "sandboxID": sbx.sandbox_id,
            "clientID": "cleanroom",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": sbx.access_token,
            "trafficAccessToken": sbx.traffic_token,
            "alias": sbx.template,
            **({"domain": self.config.domain} if self.config.domain else {}),
        }

    def listed(self, sbx: Sandbox) -> dict[str, Any]:
        """The ``ListedSandbox`` body (list) and the base of ``SandboxDetail`` (get info)."""
        limits = sbx.baseline.limits
        return {
            "templateID": sbx.template,
            "alias": sbx.template,
            "sandboxID": sbx.sandbox_id,
            "clientID": "cleanroom",
            "startedAt": iso(sbx.started_at),
            "endAt": iso(sbx.end_at or sbx.started_at + sbx.timeout_s),
            "cpuCount": int(getattr(limits, "vcpus", 1) or 1),
            "memoryMB": int(getattr(limits, "memory_mib", 256) or 256),
            "diskSizeMB": int(getattr(limits, "disk_mib", 0) or 0),
            "state": "running",
            "envdVersion": ENVD_VERSION,
            "metadata": sbx.metadata,
        }

    def detail(self, sbx: Sandbox) -> dict[str, Any]:
        return {
            **self.listed(sbx),
            "envdAccessToken": sbx.access_token,
            "trafficAccessToken": sbx.traffic_token,
            **({"domain": self.config.domain} if self.config.domain else {}),
        }
