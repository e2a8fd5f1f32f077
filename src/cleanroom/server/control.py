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
  ``episode_error``): the session ends with the guest's outcome; other sandboxes go on;
- ``pause``: the session is snapshotted (``sessions.pause``) and then ended (``completed``,
  ``info.ended = "paused"``, env destroyed and confirmed absent); the sandbox stays, paused,
  with its snapshot files; ``connect`` resumes it: a new session (episode ``<id>.r1``,
  ``.r2``, ... of the same run) restored from the snapshot, whose files are then deleted;
  ``kill`` of a paused sandbox deletes them and confirms them gone;
- ``fork``: the live session's branches (``sessions.fork``), each served as a new sandbox
  (episode ``<id>.b1``, ... of the parent's run, its record naming the parent and step);
- ``create_snapshot``: a named snapshot (``pause_session(kind="snapshot")``) taken while the
  sandbox serves on, kept by the server under its id for the key; ``create`` with that id as
  its template is a new sandbox resumed from it (a run and session of its own, provenance
  ``resumed`` naming the snapshot), as many times as asked; ``delete_snapshot`` deletes its
  files and confirms them gone; server shutdown deletes every one (as it ends paused ones).

Served sandboxes are forkable (``ServerConfig.forkable``; pause needs it too) unless they have
egress (a NIC has no snapshot) or the driver cannot fork a live env. A paused sandbox and a
named snapshot count against its key's ``max_per_key`` as a live sandbox does.

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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Driver, Owner
from cleanroom.errors import CleanroomError, SessionTimeout, SnapshotDrift, Unsupported
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunContext, RunOptions
from cleanroom.sessions import AsyncSession, CommandHandle, session
from cleanroom.sessions.fork import MAX_BRANCHES, Branch
from cleanroom.sessions.pause import Paused, discard, pause_session

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


class Conflict(ServerError):
    """A sandbox not in the state the call needs (E2B's 409)."""

    status = 409


class Busy(ServerError):
    """A sandbox that cannot do it now (a pause while commands run): E2B's 503, which its SDK
    raises as ``ServiceBusyException`` (its 409 on pause would read as "already paused")."""

    status = 503


class SnapshotNotFound(ServerError):
    """A named snapshot that is not the key's (unknown, deleted, or another key's)."""

    status = 404


class SnapshotRefused(Conflict):
    """A paused sandbox whose snapshot no longer matches its digest: it stays paused, and is
    never restored (``SnapshotDrift`` names the files)."""


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
    forkable: bool = False
    episode_id: str = ""  # its session now: the sandbox id, then ``<id>.r1``, ... once resumed
    resumes: int = 0
    pausing: asyncio.Future[Paused] | None = None  # a pause asked for, answered by ``_life``
    paused: Paused | None = None  # paused: its snapshot (no session, no env)
    branch: Branch | None = None  # a fork's branch: its session (served by ``_hold``)
    snapshot_id: str | None = None  # the named snapshot it was created from, if it was

    @property
    def live(self) -> bool:
        return self.ended is None and self.sb is not None

    @property
    def state(self) -> str:
        return "paused" if self.paused is not None and self.ended is None else "running"

    def new_pid(self) -> int:
        self.next_pid += 1
        return self.next_pid


@dataclass
class Snapshot:
    """A named snapshot (E2B's ``create_snapshot``): whose, taken of which sandbox, its files."""

    snapshot_id: str
    key_id: str
    sandbox_id: str
    template: str
    baseline: Baseline
    network: list[str] | None
    name: str | None
    paused: Paused  # ``keep``: restored any number of times
    created_at: float = field(default_factory=time.time)

    @property
    def names(self) -> list[str]:
        return [self.name] if self.name else [self.snapshot_id]


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
    forkable: bool = True  # sandboxes made forkable (pause and fork), where they can be
    placement: Placement | None = None  # sandboxes held elsewhere (``serve --ray``), else here


class Placement(Protocol):
    """Where a server's sandboxes live when not in this process (``serve --ray``): ``life``
    stands in for ``Sandboxes._life`` (the sandbox's ``sb`` set and ``ready`` answered once its
    env is ready; back once it ended, ``ended`` set, the sandbox forgotten)."""

    def life(self, sandboxes: Sandboxes, sbx: Sandbox) -> Coroutine[Any, Any, None]: ...


class Sandboxes:
    """The server's registry: sandbox id -> ``Sandbox`` (see the module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.by_id: dict[str, Sandbox] = {}
        self.snapshots: dict[str, Snapshot] = {}  # named snapshots, by id
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

    def of_key(self, key_id: str, *, paused: bool = False) -> list[Sandbox]:
        """The key's live sandboxes (and its paused ones with ``paused``)."""
        return [
            s
            for s in self.by_id.values()
            if s.key_id == key_id and (s.live or (paused and s.state == "paused"))
        ]

    def get_any(self, key_id: str, sandbox_id: str) -> Sandbox:
        """The sandbox ``sandbox_id`` of ``key_id``, live or paused (else ``SandboxNotFound``)."""
        return self.get_paused(key_id, sandbox_id) or self.get(key_id, sandbox_id)

    def get_paused(self, key_id: str, sandbox_id: str) -> Sandbox | None:
        """The paused sandbox ``sandbox_id`` of ``key_id``, else None."""
        sbx = self.by_id.get(sandbox_id)
        if sbx is None or sbx.key_id != key_id or sbx.state != "paused":
            return None
        return sbx

    def _quota(self, key_id: str, max_per_key: int, more: int = 1) -> None:
        """``LimitReached`` unless ``more`` sandboxes fit the key's and the server's limits
        (a paused sandbox and a named snapshot count: each holds a guest's state on disk)."""
        held = len(self.of_key(key_id, paused=True)) + len(self.snapshots_of(key_id))
        if held + more > max_per_key:
            raise LimitReached(
                f"at most {max_per_key} sandboxes per key at once (paused ones count,"
                " and snapshots)",
                1.0,
            )
        live = sum(1 for s in self.by_id.values() if s.ended is None)
        if live + more > self.config.max_sandboxes:
            raise LimitReached(f"at most {self.config.max_sandboxes} sandboxes at once", 1.0)

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
        sandbox_id: str | None = None,
    ) -> Sandbox:
        """A new live sandbox (its env ready); ``LimitReached`` over a limit. ``sandbox_id``:
        the id a head server chose (``serve --ray``), else a new one."""
        if self.closing:
            raise LimitReached("the server is shutting down", 5.0)
        snap = None  # a snapshot's id or name; another key's is an unknown template
        if template not in self.config.templates:
            snap = self.snapshot_named(key_id, template)
        if snap is not None:
            return await self._from_snapshot(
                key_id, snap, timeout_s, metadata, envs, max_per_key, sandbox_id
            )
        if template not in self._baselines:  # one build of a template at a time
            async with self._resolving:
                await asyncio.to_thread(self.baseline, template)
        baseline = self.baseline(template)
        self._quota(key_id, max_per_key)
        timeout = float(timeout_s or DEFAULT_TIMEOUT_S)
        timeout = max(1.0, min(timeout, self.config.max_lifetime_s))
        sandbox_id = sandbox_id or "i" + secrets.token_hex(10)
        sbx = Sandbox(
            sandbox_id=sandbox_id,
            key_id=key_id,
            template=template,
            baseline=baseline,
            metadata=dict(metadata),
            envs=dict(envs),
            access_token=secrets.token_urlsafe(24),
            timeout_s=timeout,
            network=network,
            episode_id=sandbox_id,
        )
        cfg = self.config
        sbx.forkable = (
            cfg.placement is None  # pause and fork are not routed to a placement
            and cfg.forkable
            and cfg.driver.capabilities.fork_live
            and (network == [] or (network is None and not baseline.network))
        )
        self.by_id[sbx.sandbox_id] = sbx
        life = cfg.placement.life(self, sbx) if cfg.placement else self._life(sbx)
        await self._start(sbx, life)
        return sbx

    async def _start(self, sbx: Sandbox, life: Any) -> None:
        """Run ``life`` (the sandbox's session, held open) in a task; return once it is ready."""
        loop = asyncio.get_running_loop()
        sbx.ready = loop.create_future()
        sbx.stop = asyncio.Event()
        sbx.task = loop.create_task(life, name=f"sandbox {sbx.sandbox_id}")
        try:
            await asyncio.shield(sbx.ready)
        except asyncio.CancelledError:
            sbx.stop.set()  # the client went away before it was ready: nobody can use it
            raise

    async def _serve(self, sbx: Sandbox, sb: AsyncSession) -> None:
        """Hold the session open until the sandbox is killed (or its guest fails a call)."""
        while not sbx.stop.is_set():
            if sb.guard.failed_by is not None:  # the guest broke or died in a call
                raise sb.guard.failed_by  # its outcome (``interact``), its record
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sbx.stop.wait(), GUEST_CHECK_S)

    async def _life(self, sbx: Sandbox, resume: Paused | None = None) -> None:
        """The sandbox's session (a new one, or ``resume``'s snapshot restored), held open."""
        opened = session(
            sbx.baseline,
            driver=self.config.driver,
            episode_id=sbx.episode_id,
            run_id=f"serve-{sbx.sandbox_id}",
            options=self.config.options,
            timeout_s=self.config.max_lifetime_s,
            network=sbx.network,
            task={
                "template": sbx.template,
                "metadata": sbx.metadata,
                "served": True,
                **({"snapshot": sbx.snapshot_id} if sbx.snapshot_id else {}),
            },
            owner=self.owner,
            forkable=sbx.forkable,
            resume=resume,
        )
        await self._hold(sbx, opened, resume)

    async def _hold(
        self,
        sbx: Sandbox,
        opened: contextlib.AbstractAsyncContextManager[AsyncSession],
        resume: Paused | None = None,
    ) -> None:
        """Serve ``opened`` as ``sbx`` until it is killed, paused or fails; then say why it
        ended and forget it (or keep it, paused)."""
        assert sbx.ready is not None
        paused: Paused | None = None
        try:
            async with opened as sb:
                sbx.sb, sbx.paused = sb, None
                if sb.guard.lifetime is None:  # a fork's branch: its clocks start now
                    sb.start_clocks(self.config.max_lifetime_s, None)
                self._deadline(sbx, sbx.timeout_s)
                sbx.ready.set_result(None)
                paused = await self._until_paused_or_killed(sbx, sb)
                why = "paused" if paused is not None else "killed"
                sbx.ended = None if paused is not None else why
                info: dict[str, Any] = {"ended": why, "sandbox_id": sbx.sandbox_id}
                if paused is not None:
                    info.update(snapshot=paused.digest, snapshot_id=paused.snap.snapshot_id)
                sb.finish(0.0, info=info)
        except SessionTimeout:
            sbx.ended = "timeout"
        except asyncio.CancelledError:
            sbx.ended = sbx.ended or "cancelled"
            raise
        except BaseException as exc:
            if (
                resume is not None
                and not resume.keep  # a named snapshot's new sandbox is no paused one
                and not sbx.ready.done()
                and self._kept(resume)
            ):
                paused = resume  # the resume failed before the env was ready: still paused
            else:
                sbx.ended = sbx.ended or f"failed: {type(exc).__name__}"
            if not sbx.ready.done():
                sbx.ready.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            sbx.sb = None
            if paused is not None and sbx.ended is None:
                sbx.paused = paused  # its session ended; the sandbox waits, paused
                if sbx.pausing is not None and not sbx.pausing.done():
                    sbx.pausing.set_result(paused)
                sbx.pausing = None
            else:
                sbx.ended = sbx.ended or "closed"
                self.ended[sbx.ended.split(":")[0]] += 1
                if not sbx.ready.done():
                    msg = f"sandbox {sbx.sandbox_id} ended at start"
                    sbx.ready.set_exception(ServerError(msg))
                if sbx.pausing is not None and not sbx.pausing.done():
                    sbx.pausing.set_exception(Conflict(f"sandbox {sbx.sandbox_id} ended"))
                self.by_id.pop(sbx.sandbox_id, None)
            for proc in sbx.processes.values():
                proc.emit("gone", None)
            sbx.processes.clear()

    async def _until_paused_or_killed(self, sbx: Sandbox, sb: AsyncSession) -> Paused | None:
        """Serve until killed (None) or paused (its snapshot); a pause that fails is answered
        with its error and the sandbox serves on."""
        while True:
            await self._serve(sbx, sb)
            if sbx.pausing is None:
                return None
            try:
                return await pause_session(sb)
            except CleanroomError as exc:
                sbx.pausing.set_exception(exc)
                sbx.pausing = None
                sbx.stop.clear()

    def _kept(self, paused: Paused) -> bool:
        """Whether a paused snapshot's files are still there (a failed resume keeps them)."""
        return paused.snap.snapshot_id in self.config.driver.list_snapshots()

    # -- pause, resume ----------------------------------------------------------------------

    async def pause(self, key_id: str, sandbox_id: str) -> bool:
        """Pause the sandbox (module docstring); False if it was paused already. Returns once
        its snapshot is sealed and its env destroyed and confirmed absent."""
        if self.get_paused(key_id, sandbox_id) is not None:
            return False
        sbx = self.get(key_id, sandbox_id)
        _savable(sbx, "paused")
        if sbx.pausing is None:
            sbx.pausing = asyncio.get_running_loop().create_future()
            sbx.stop.set()
        try:
            await asyncio.shield(sbx.pausing)
        except Unsupported as exc:
            raise Conflict(f"sandbox {sandbox_id} cannot be paused: {exc}") from exc
        return True

    async def resume(self, key_id: str, sandbox_id: str) -> Sandbox:
        """The paused sandbox restored into a new env (a new session, ``<id>.rN``); a running
        one as it is. ``SnapshotRefused`` if its snapshot no longer matches its digest."""
        sbx = self.get_paused(key_id, sandbox_id)
        if sbx is None:
            return self.get(key_id, sandbox_id)
        if self.closing:
            raise LimitReached("the server is shutting down", 5.0)
        paused = sbx.paused
        assert paused is not None
        sbx.resumes += 1
        sbx.episode_id = f"{sbx.sandbox_id}.r{sbx.resumes}"
        sbx.started_at = time.time()
        try:
            await self._start(sbx, self._life(sbx, resume=paused))
        except SnapshotDrift as exc:
            raise SnapshotRefused(f"sandbox {sandbox_id} cannot resume: {exc}") from exc
        return sbx

    async def _discard(self, sbx: Sandbox) -> bool:
        """Delete a paused sandbox's snapshot; True once confirmed absent (the ledger says)."""
        assert sbx.paused is not None
        with Ledger() as ledger:
            ctx = RunContext(self.config.driver, ledger, None, self.owner, self.config.options)
            return await discard(ctx, sbx.paused)

    # -- named snapshots --------------------------------------------------------------------

    def snapshots_of(self, key_id: str, sandbox_id: str | None = None) -> list[Snapshot]:
        """The key's named snapshots (of ``sandbox_id`` only, if given), oldest first."""
        found = [
            s
            for s in self.snapshots.values()
            if s.key_id == key_id and (sandbox_id is None or s.sandbox_id == sandbox_id)
        ]
        return sorted(found, key=lambda s: (s.created_at, s.snapshot_id))

    def snapshot_named(self, key_id: str, ref: str) -> Snapshot | None:
        """The key's snapshot ``ref`` (its id, or its name: the newest of that name)."""
        snap = self.snapshots.get(ref)
        if snap is not None:
            return snap if snap.key_id == key_id else None
        named = [s for s in self.snapshots_of(key_id) if s.name == ref]
        return named[-1] if named else None

    async def create_snapshot(
        self, key_id: str, sandbox_id: str, name: str | None, max_per_key: int
    ) -> Snapshot:
        """A named snapshot of the live sandbox, taken while it serves on (module docstring)."""
        sbx = self.get(key_id, sandbox_id)
        if self.closing:
            raise LimitReached("the server is shutting down", 5.0)
        _savable(sbx, "snapshotted")
        if sbx.pausing is not None:
            raise Busy(f"sandbox {sandbox_id} is being paused")
        self._quota(key_id, max_per_key)
        assert sbx.sb is not None
        try:
            paused = await pause_session(sbx.sb, kind="snapshot")
        except Unsupported as exc:
            raise Conflict(f"sandbox {sandbox_id} cannot be snapshotted: {exc}") from exc
        snap = Snapshot(
            snapshot_id=paused.snap.snapshot_id,
            key_id=key_id,
            sandbox_id=sandbox_id,
            template=sbx.template,
            baseline=sbx.baseline,
            network=sbx.network,
            name=name,
            paused=paused,
        )
        self.snapshots[snap.snapshot_id] = snap
        return snap

    async def _from_snapshot(
        self,
        key_id: str,
        snap: Snapshot,
        timeout_s: float | None,
        metadata: dict[str, str],
        envs: dict[str, str],
        max_per_key: int,
        sandbox_id: str | None,
    ) -> Sandbox:
        """A new sandbox resumed from the named snapshot (its files stay for the next)."""
        if self.config.placement is not None:
            raise Conflict("sandboxes from snapshots are not served through a placement")
        self._quota(key_id, max_per_key)
        timeout = max(1.0, min(float(timeout_s or DEFAULT_TIMEOUT_S), self.config.max_lifetime_s))
        sandbox_id = sandbox_id or "i" + secrets.token_hex(10)
        sbx = Sandbox(
            sandbox_id=sandbox_id,
            key_id=key_id,
            template=snap.template,
            baseline=snap.baseline,
            metadata=dict(metadata),
            envs=dict(envs),
            access_token=secrets.token_urlsafe(24),
            timeout_s=timeout,
            network=snap.network,
            episode_id=sandbox_id,
            forkable=True,
            snapshot_id=snap.snapshot_id,
        )
        self.by_id[sandbox_id] = sbx
        try:
            await self._start(sbx, self._life(sbx, resume=snap.paused))
        except SnapshotDrift as exc:
            raise SnapshotRefused(f"snapshot {snap.snapshot_id} cannot be restored: {exc}") from exc
        return sbx

    async def delete_snapshot(self, key_id: str, snapshot_id: str) -> None:
        """Delete the key's named snapshot: its files deleted and confirmed gone."""
        snap = self.snapshot_named(key_id, snapshot_id)
        if snap is None or snap.snapshot_id != snapshot_id:
            raise SnapshotNotFound(f"snapshot {snapshot_id!r} not found")
        await self._delete_snapshot(snap)

    async def _delete_snapshot(self, snap: Snapshot) -> None:
        self.snapshots.pop(snap.snapshot_id, None)
        with Ledger() as ledger:
            ctx = RunContext(self.config.driver, ledger, None, self.owner, self.config.options)
            gone = await discard(ctx, snap.paused)
        if not gone:
            raise ServerError(f"snapshot {snap.snapshot_id} could not be deleted")

    # -- fork -------------------------------------------------------------------------------

    async def fork(
        self, key_id: str, sandbox_id: str, count: int, timeout_s: float | None, max_per_key: int
    ) -> list[Sandbox]:
        """``count`` new sandboxes, each a branch of this one's session as it is now."""
        sbx = self.get(key_id, sandbox_id)
        if not 1 <= count <= MAX_BRANCHES:
            raise ServerError(f"count must be 1..{MAX_BRANCHES}")
        _forkable(sbx, "forked")
        self._quota(key_id, max_per_key, count)
        assert sbx.sb is not None
        try:
            branches = await sbx.sb.fork(count)
        except Unsupported as exc:
            raise Conflict(f"sandbox {sandbox_id} cannot be forked: {exc}") from exc
        timeout = max(1.0, min(float(timeout_s or DEFAULT_TIMEOUT_S), self.config.max_lifetime_s))
        out = []
        for branch in branches:
            assert isinstance(branch, Branch)
            child = Sandbox(
                sandbox_id="i" + secrets.token_hex(10),
                key_id=key_id,
                template=sbx.template,
                baseline=sbx.baseline,
                metadata=dict(sbx.metadata),
                envs=dict(sbx.envs),
                access_token=secrets.token_urlsafe(24),
                timeout_s=timeout,
                network=sbx.network,
                episode_id=branch.episode_id,
                branch=branch,
            )
            self.by_id[child.sandbox_id] = child
            await self._start(child, self._hold(child, branch))
            out.append(child)
        return out

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
        """End the sandbox; returns once its session closed (env destroyed, confirmed), or, a
        paused one, once its snapshot's files are deleted and confirmed gone."""
        paused = self.get_paused(key_id, sandbox_id)
        if paused is not None:
            await self._end_paused(paused, "killed")
            return
        sbx = self.get(key_id, sandbox_id)
        sbx.stop.set()
        assert sbx.task is not None
        with contextlib.suppress(Exception):
            await asyncio.shield(sbx.task)

    async def close(self, grace_s: float = 120.0) -> None:
        """Server shutdown: every sandbox ends ``cancelled``, durable, destroyed, confirmed."""
        self.closing = True
        for sbx in [s for s in self.by_id.values() if s.state == "paused"]:
            await self._end_paused(sbx, "cancelled")
        for snap in list(self.snapshots.values()):
            with contextlib.suppress(ServerError):  # the reaper's, once this owner is dead
                await self._delete_snapshot(snap)
        tasks = [s.task for s in self.by_id.values() if s.task is not None and not s.task.done()]
        for t in tasks:
            t.cancel("cleanroom serve is shutting down")
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)

    async def _end_paused(self, sbx: Sandbox, why: str) -> None:
        """A paused sandbox ends: its snapshot deleted (and confirmed gone), then forgotten."""
        sbx.ended = why
        try:
            gone = await self._discard(sbx)
        finally:
            self.ended[why] += 1
            self.by_id.pop(sbx.sandbox_id, None)
        if not gone:
            raise ServerError(f"sandbox {sbx.sandbox_id}: its snapshot could not be deleted")

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
            "state": sbx.state,
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


def _forkable(sbx: Sandbox, what: str) -> None:
    """Conflict unless the sandbox's state can be saved (``what``: "paused", ...)."""
    if not sbx.forkable:
        why = "it has egress" if sbx.network else "the server made it unforkable"
        raise Conflict(f"sandbox {sbx.sandbox_id} cannot be {what}: {why}")


def _savable(sbx: Sandbox, what: str) -> None:
    """``_forkable``, and Busy while commands run: the agent prepares a snapshot between
    requests, never during one."""
    _forkable(sbx, what)
    running = sorted(pid for pid, proc in sbx.processes.items() if proc.result is None)
    if running:
        raise Busy(f"sandbox {sbx.sandbox_id} cannot be {what} while commands run: {running}")
