"""The driver protocol: create an environment, talk to its agent, destroy it, prove it is gone.

Like an httpx transport, a driver is small: ``create`` returns a ready ``Env`` (or raises and
leaves nothing behind), ``destroy`` is idempotent and ends with a confirm-absent check,
``exists`` and ``list_owned`` look at the host itself (processes, run folders), not at memory.
A driver with the capability ``fork`` can also save a running env (``fork_parent``,
``fork_save``) and restore new envs from that snapshot (``fork_clone``); see ``groups.py``.
With ``fork-live`` too, ``fork_live`` saves a parent that lives on (a session's branches,
``sessions/fork.py``).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import os
import secrets
import socket
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Unpack

from cleanroom.agent.commands import CommandOptions, SpawnOptions
from cleanroom.agent.connection import AgentConnection, EpisodeOutput, ExecResult, GuestProcess
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.errors import DriverError, Unsupported
from cleanroom.host import hostproc
from cleanroom.host.cgroups import EnvGroups
from cleanroom.network.qemu_args import Attachment


def new_env_id() -> str:
    """A fresh, unguessable environment id."""
    return "env-" + secrets.token_hex(8)


def new_snapshot_id() -> str:
    """A fresh id for a warm env's snapshot (a fork's files on the host)."""
    return "snap-" + secrets.token_hex(8)


@dataclass(frozen=True)
class Owner:
    """Who created an environment: the reaper destroys envs whose owner is gone."""

    controller_id: str
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)

    def ledger_fields(self) -> dict[str, Any]:
        """The owner columns of a ledger env row (``Ledger.env_intent(..., **fields)``)."""
        return {
            "owner_controller": self.controller_id,
            "owner_pid": self.pid,
            "owner_host": self.host,
        }


@dataclass(frozen=True)
class EnvRequest:
    """Everything a driver needs to create one environment."""

    env_id: str
    baseline: Baseline
    limits: ResolvedLimits
    owner: Owner
    hard_deadline_s: float  # the host kills the env after this, even if the controller is gone
    labels: dict[str, str] = field(default_factory=dict)
    network: Attachment | None = None  # egress through a proxy (drivers with "egress" only)


def start_label(start_kind: str, spare_s: float | None) -> str:
    """``spare`` for a spare clone (one that waited ``spare_s``), else the start kind
    (``snapshot``, ``fork``, ``cold``)."""
    return "spare" if spare_s is not None else start_kind


@dataclass(frozen=True)
class EnvInfo:
    env_id: str
    driver: str
    accelerator: str  # "kvm", "tcg", "none", ...
    isolation: str  # "hardware-vm", "emulated-vm", "userspace-kernel", "none"
    pid: int | None
    run_dir: Path | None
    created_at: float
    ready_s: float  # create -> agent ready
    start_kind: str = "cold"  # "cold" (booted) or "snapshot" (a clone restored from a template)
    template: str | None = None  # the template's digest when start_kind == "snapshot"
    start_note: str | None = None  # why a snapshot start fell back to cold (or was rebuilt)
    group: dict[str, Any] | None = None  # the group it belongs to (set by groups.py)
    branch: dict[str, Any] | None = None  # the live session it forked from (sessions/fork.py)
    resumed: dict[str, Any] | None = None  # the paused session it resumes (sessions/pause.py)
    spare_s: float | None = None  # a spare clone: how long it waited, paused, before its use
    jail: dict[str, Any] | None = None  # what confines it and names its processes (cgroup, ...)
    console: hostproc.Ring | None = field(default=None, compare=False, repr=False)  # its ring

    @property
    def started_as(self) -> str:
        """How it started, as logs, metrics and reports label it (``start_label``)."""
        return start_label(self.start_kind, self.spare_s)

    def start_facts(self) -> dict[str, Any]:
        """How this env started, for provenance (``start``, ``template``, ``start_note``,
        ``group``, ``spare_s``, ``jail`` where the driver records one, ``branch`` for a
        session's branch, ``resumed`` for a resumed one), and
        ``console_bytes``: what its console printed so far, where the driver reads one."""
        facts: dict[str, Any] = {
            "start": self.start_kind,
            "template": self.template,
            "start_note": self.start_note,
            "group": self.group,
            "spare_s": self.spare_s,
        }
        if self.jail is not None:
            facts["jail"] = self.jail
        if self.branch is not None:
            facts["branch"] = self.branch
        if self.resumed is not None:
            facts["resumed"] = self.resumed
        if self.console is not None:
            facts["console_bytes"] = self.console.total
        return facts

    def ledger_fields(self) -> dict[str, Any]:
        """The columns ``Ledger.env_created(env_id, **fields)`` records once the env exists."""
        return {
            "pid": self.pid or 0,
            "run_dir": str(self.run_dir or ""),
            "accelerator": self.accelerator,
        }


@dataclass(frozen=True)
class ForkSnapshot:
    """A saved warm env: clones restore from it; ``Driver.delete_snapshot`` removes it."""

    snapshot_id: str
    driver: str
    digest: str | None  # "sha256:..." over its content; None until sealed (``fork_sealed``)
    path: Path | None
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DestroyReport:
    env_id: str
    confirmed_absent: bool
    attempts: int
    elapsed_ms: float
    detail: str = ""


class Env:
    """A live environment with a connected agent. ``aclose()`` destroys it (idempotent)."""

    def __init__(self, driver: Driver, info: EnvInfo, session: AgentConnection) -> None:
        self.driver = driver
        self.info = info
        self.session = session
        self._closed: DestroyReport | None = None

    @property
    def env_id(self) -> str:
        return self.info.env_id

    @property
    def hello(self) -> dict[str, Any]:
        return self.session.hello

    @property
    def features(self) -> frozenset[str]:
        """What its agent serves beyond the first protocol (HELLO ``features``)."""
        return self.session.features

    async def exec(
        self, argv: list[str], *, stdin: bytes | None = None, **options: Unpack[CommandOptions]
    ) -> ExecResult:
        """Run ``argv`` to its end (``user`` None: root); output reaches the callbacks as it
        comes. Several run at once on one env. The exit code is data (``check()`` raises)."""
        return await self.session.exec(argv, stdin=stdin, **options)

    async def spawn(self, argv: list[str], **options: Unpack[SpawnOptions]) -> GuestProcess:
        """Start ``argv`` in the background: ``write_stdin``, ``close_stdin``, ``kill`` (its
        process group), ``resize`` (with ``pty=(rows, cols)``), ``wait``."""
        return await self.session.spawn(argv, **options)

    async def put(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await self.session.put(path, data, mode)

    async def get(self, path: str, *, max_size: int = 64 * 1024 * 1024) -> bytes:
        """The whole file (``GuestFileNotFound`` if missing, ``QuotaExceeded`` past
        ``max_size``)."""
        return await self.session.get(path, max_size=max_size)

    async def put_stream(self, path: str, chunks: AsyncIterable[bytes], mode: int = 0o644) -> int:
        """Write a stream of any size to ``path``; returns its size."""
        return await self.session.put_stream(path, chunks, mode)

    def get_stream(self, path: str) -> AsyncIterator[bytes]:
        """The file at ``path``, chunk by chunk (``GuestFileNotFound`` if missing)."""
        return self.session.get_stream(path)

    async def put_tar(self, dest_dir: str, chunks: AsyncIterable[bytes]) -> int:
        """Unpack a tar stream into ``dest_dir`` (the guest refuses escapes and devices)."""
        return await self.session.put_tar(dest_dir, chunks)

    def get_tar(self, src_dir: str) -> AsyncIterator[bytes]:
        """The folder ``src_dir`` as a tar stream."""
        return self.session.get_tar(src_dir)

    async def run_episode(
        self, request: dict[str, Any], staging: Path, *, quota_bytes: int
    ) -> EpisodeOutput:
        """RUN the episode; where the driver reads a console, what it prints meanwhile is
        charged to the same quota (``hostproc.charged_to_console``)."""
        if self.info.console is None:
            return await self.session.run_episode(request, staging, quota_bytes=quota_bytes)
        return await hostproc.charged_to_console(
            self.info.console,
            quota_bytes,
            lambda charged: self.session.run_episode(
                request, staging, quota_bytes=quota_bytes, charged=charged
            ),
        )

    def alive(self) -> bool:
        """Is the environment's process still running?"""
        return self.driver.alive(self.env_id)

    def diagnostics(self) -> dict[str, bytes]:
        """Whatever can still be read about the env (e.g. console tail), for export."""
        return self.driver.diagnostics(self.env_id)

    async def aclose(self) -> DestroyReport:
        if self._closed is None:
            await self.session.aclose()
            self._closed = await self.driver.destroy(self.env_id)
        return self._closed

    async def __aenter__(self) -> Env:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass(frozen=True)
class Capabilities:
    """What a driver offers beyond creating and destroying envs, declared once (as Harbor's
    ``EnvironmentCapabilities``), checked by attribute: a misspelt one fails type-checking
    instead of silently reading as absent."""

    exec: bool = True  # commands in the env
    files: bool = True  # files in and out
    console: bool = False  # a console log kept as evidence
    snapshot: bool = False  # envs restored from a template's snapshot
    egress: bool = False  # an egress allowlist enforced (networked envs)
    fork: bool = False  # a warm env saved and restored many times (groups: ``fork_parent``)
    fork_live: bool = False  # a live session branched (``sessions.fork``)
    spares: bool = False  # envs started ahead and handed out by id

    def with_(self, **changes: bool) -> Capabilities:
        """These capabilities with ``changes`` (a test driver that adds one)."""
        return dataclasses.replace(self, **changes)


class Driver(abc.ABC):
    """A backend that creates and destroys environments."""

    name: str = "abstract"
    capabilities: Capabilities = Capabilities(exec=False, files=False)
    groups: EnvGroups | None = None  # its envs' cgroups (or marker fallback), where it has them

    @abc.abstractmethod
    async def create(self, request: EnvRequest) -> Env:
        """Create an env and wait for its agent; on any failure destroy what exists, then raise."""

    @abc.abstractmethod
    async def destroy(self, env_id: str) -> DestroyReport:
        """Destroy an env and confirm it absent. Idempotent: an absent env reports confirmed."""

    @abc.abstractmethod
    def exists(self, env_id: str) -> bool:
        """Does anything of this env remain on the host (process, run folder, socket)?"""

    @abc.abstractmethod
    def list_owned(self) -> list[str]:
        """Env ids of every env of this driver found on the host (for reaping)."""

    def alive(self, env_id: str) -> bool:
        return self.exists(env_id)

    def owner_of(self, env_id: str) -> dict[str, Any] | None:
        """The owner record the driver left on the host for this env, if any."""
        return None

    def env_pids(self, env_id: str) -> list[int]:
        """The env's host processes (its cgroup's); [] where the driver cannot tell."""
        return [p for p in self.groups.pids(env_id) if p > 0] if self.groups is not None else []

    def diagnostics(self, env_id: str) -> dict[str, bytes]:
        return {}

    def describe(self) -> dict[str, str]:
        """Driver and accelerator facts for provenance."""
        return {"driver": self.name}

    # -- spares (capability "spares"): envs started ahead, handed out by id ---------------------

    def keep_spares(self, count: int) -> None:
        """Keep up to ``count`` envs per shape started ahead (0: none)."""
        return None

    def next_env_id(self, baseline: Baseline, limits: ResolvedLimits) -> str:
        """The id for the next env of this shape: a spare's, reserved (``create`` with it then
        resumes the spare), or a fresh one. Create or destroy it: a reserved spare is running."""
        return new_env_id()

    async def release_spares(self) -> list[DestroyReport]:
        """Destroy every spare nobody took; the reports of those destroys."""
        return []

    # -- fork (capability "fork"): save one warm env, restore many ------------------------------

    async def fork_parent(self, request: EnvRequest, snapshot_id: str) -> Env:
        """An env that ``fork_save`` can snapshot into ``snapshot_id`` (its files first)."""
        raise DriverError(f"the {self.name} driver cannot fork")

    async def fork_save(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        """Pause and save ``env``, destroy it (confirmed absent), then seal the snapshot."""
        raise DriverError(f"the {self.name} driver cannot fork")

    async def fork_live(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        """Save ``env`` (made by ``fork_parent``) into ``snapshot_id`` and let it run on; the
        snapshot is sealed like ``fork_save``'s. ``Unsupported`` where the driver cannot."""
        raise Unsupported(f"the {self.name} driver cannot fork a live env")

    async def fork_sealed(self, snap: ForkSnapshot) -> ForkSnapshot:
        """``snap`` with its digest, once sealed (a driver may hash it while clones restore);
        raises if its files changed before they were hashed."""
        return snap

    async def fork_clone(self, request: EnvRequest, snap: ForkSnapshot) -> Env:
        """A new env restored from ``snap``, with its own entropy and clone id."""
        raise DriverError(f"the {self.name} driver cannot fork")

    async def fork_resume(self, request: EnvRequest, snap: ForkSnapshot, snapshot_id: str) -> Env:
        """A fork parent (as ``fork_parent``: its RAM in a file of its own, ``snapshot_id``)
        restored from the sealed ``snap``: a paused session resumed, forkable again."""
        raise Unsupported(f"the {self.name} driver cannot resume a snapshot")

    async def verify_snapshot(self, snap: ForkSnapshot) -> None:
        """Hash ``snap``'s files again; ``SnapshotDrift`` naming those that no longer match
        the digest it was sealed with (a paused sandbox is checked so before it resumes)."""
        raise Unsupported(f"the {self.name} driver cannot verify a snapshot")

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """Delete a snapshot's files; True once confirmed absent. Idempotent."""
        return True

    def list_snapshots(self) -> list[str]:
        """Snapshot ids whose files are on the host (for reaping)."""
        return []

    def snapshot_owner(self, snapshot_id: str) -> dict[str, Any] | None:
        """The owner record left with a snapshot's files, if any."""
        return None


class RunFolderDriver(Driver):
    """A driver whose envs each have a run folder on the host (with the owner record) and, while
    this process holds them, a child process whose console tail it keeps (``_live``)."""

    _live: Mapping[str, hostproc.ConsoleProcess]

    @abc.abstractmethod
    def run_dir(self, env_id: str) -> Path:
        """The env's run folder (it may not exist)."""

    def owner_of(self, env_id: str) -> dict[str, Any] | None:
        return read_owner(self.run_dir(env_id))

    def diagnostics(self, env_id: str) -> dict[str, bytes]:
        live = self._live.get(env_id)
        return {"console.log": live.console_tail()} if live is not None else {}

    def alive(self, env_id: str) -> bool:
        live = self._live.get(env_id)
        if live is not None:
            return live.proc.returncode is None
        return bool(hostproc.pids_with_marker(env_id))


async def fail_launch(
    destroy: Callable[[str], Awaitable[DestroyReport]],
    env_id: str,
    console_tail: bytes,
    exc: BaseException,
    timeout_s: float,
    what: str,
) -> NoReturn:
    """A create() went wrong after the env existed: ``destroy`` it (shielded), then raise.

    A timeout or a driver error becomes a ``LaunchError`` carrying the console tail (its last
    lines in the message, all of it as ``console``: the attempt's evidence); anything else
    (cancellation included) propagates unchanged.
    """
    from cleanroom.errors import LaunchError

    tail = console_tail.decode(errors="replace")[-800:]
    await asyncio.shield(destroy(env_id))
    if isinstance(exc, TimeoutError):
        raise LaunchError(
            f"guest agent not ready within {timeout_s:.0f}s ({what}); console:\n{tail}",
            console_tail,
        ) from exc
    if isinstance(exc, DriverError):
        raise LaunchError(f"{exc}; console:\n{tail}", console_tail) from exc
    raise exc


def refuse_network(driver: Driver, request: EnvRequest) -> None:
    """Refuse a request with egress from a driver that cannot enforce an allowlist."""
    if request.network is not None and not driver.capabilities.egress:
        from cleanroom.errors import NetworkPolicyError

        raise NetworkPolicyError(f"the {driver.name} driver cannot enforce an egress allowlist")


def write_owner(run_dir: Path, request: EnvRequest, driver: str) -> None:
    """Leave who owns this env in its run folder, for a reaper in another process."""
    import json

    owner = {
        "env_id": request.env_id,
        "driver": driver,
        "controller_id": request.owner.controller_id,
        "pid": request.owner.pid,
        "host": request.owner.host,
        "created_at": time.time(),
        "hard_deadline_s": request.hard_deadline_s,
        "labels": request.labels,
    }
    (run_dir / "owner.json").write_text(json.dumps(owner))


def read_owner(run_dir: Path) -> dict[str, Any] | None:
    import json

    try:
        data = json.loads((run_dir / "owner.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


async def confirm_gone(driver: Driver, env_id: str, window_s: float = 2.0) -> bool:
    """Poll ``exists`` until it is false or the window ends."""

    end = time.monotonic() + window_s
    delay = 0.001
    while driver.exists(env_id):
        if time.monotonic() > end:
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True
