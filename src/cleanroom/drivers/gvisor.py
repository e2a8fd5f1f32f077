"""The gvisor driver: one ``runsc`` sandbox per environment (a user-space kernel, no VM).

Per env: a run folder ``$CLEANROOM_HOME/run/gvisor/<env_id>/`` (owner.json, pid and the OCI
bundle ``cleanroom-<env_id>/``) and a socket folder (``drivers/sockets.py``: a short path) with
the agent socket the driver listens on, bind-mounted into the sandbox. The root
is the baseline's root tree (``gvisor_bundle``: extracted once from ``rootfs.erofs``, verified)
under runsc's memory overlay, so every write of the episode dies with the sandbox; no network
(``--network=none``); the same guest agent as in a VM, PID 1 of the sandbox, connects to the
bind-mounted socket (``--host-uds=open``). The container id is the env marker
(``cleanroom-<env_id>``), so the sandbox, its gofer (via the bundle path) and its ptrace stubs
all carry it. ``runsc run`` runs under ``hostproc.supervised`` and keeps the sandbox attached:
it dies with its controller and at its hard deadline. Like a qemu env, the env's processes
live in an identity cgroup only the controller makes (``cgroups.EnvGroups``, the driver's own
scope; runsc's own per-controller cgroups hold its limits): ``runsc run`` joins it before it
execs, so the sandbox, gofer and stubs are inside; a marker alone counts only in a process of
ours (``cgroups.own_pids_with_marker``), never another user's.

destroy = ``runsc kill`` (then SIGKILL of the supervisor group if needed), ``runsc delete
--force``, a kill of the identity cgroup and SIGKILL (by pidfd) of any process of ours still
carrying the marker, removal of the cgroups and the run and socket folders, then a
confirm-absent check: no process, no run or socket folder, no runsc state, no cgroup.
``CLEANROOM_GVISOR_PLATFORM`` picks the runsc platform (``ptrace`` by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from cleanroom.agent.connection import AgentConnection
from cleanroom.drivers import gvisor_bundle as bundle_mod
from cleanroom.drivers import sockets
from cleanroom.drivers.base import (
    Capabilities,
    DestroyReport,
    Env,
    EnvInfo,
    EnvRequest,
    RunFolderDriver,
    fail_launch,
    refuse_network,
    write_owner,
)
from cleanroom.errors import ConfigError, LaunchError
from cleanroom.host import cgroups, hostproc, jail, paths

RUNSC = "runsc"
ISOLATION = "userspace-kernel"
EXIT_WAIT_S = 0.05  # a sandbox whose agent saw its channel close exits within this
GRACE_S = 1.0
RUNSC_CALL_TIMEOUT_S = 10.0


@functools.cache
def runsc_version() -> str:
    """``runsc --version`` (first line's version), or ConfigError if runsc is not usable."""
    try:
        out = subprocess.run(
            [RUNSC, "--version"], capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"{RUNSC} is not usable ({exc}); run `apt-get install runsc`") from exc
    match = re.search(r"runsc version (\S+)", out.stdout)
    return match.group(1) if match else out.stdout.strip().splitlines()[0]


def _version_or_unknown() -> str:
    try:
        return runsc_version()
    except ConfigError:
        return "unknown"


def default_platform() -> str:
    return os.environ.get("CLEANROOM_GVISOR_PLATFORM", "ptrace")


class _Live(hostproc.ConsoleProcess):
    """What the driver holds for a sandbox it started in this process."""


class GvisorDriver(RunFolderDriver):
    """Fresh gVisor sandboxes from a baseline's root tree."""

    name = "gvisor"
    groups: cgroups.EnvGroups
    capabilities = Capabilities(console=True)

    def __init__(
        self,
        *,
        ready_timeout_s: float = 60.0,
        run_root: Path | None = None,
        runsc_root: Path | None = None,
        platform: str | None = None,
    ) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.run_root = run_root or paths.run_dir() / self.name
        self.runsc_root = runsc_root or self.run_root / "runsc-root"
        self.platform = platform or default_platform()
        self._live: dict[str, _Live] = {}
        scope = cgroups.scope_of(self.name, self.run_root)
        self.groups = cgroups.EnvGroups(cgroups.detect(), scope)

    @property
    def accelerator(self) -> str:
        return f"runsc-{self.platform}"

    def run_dir(self, env_id: str) -> Path:
        return self.run_root / env_id

    def describe(self) -> dict[str, str]:
        return {
            "driver": self.name,
            "accelerator": self.accelerator,
            "accelerator_version": f"runsc {_version_or_unknown()}",
            "isolation": ISOLATION,
        }

    def _runsc(self, *args: str) -> list[str]:
        return [RUNSC, f"--root={self.runsc_root}", *args]

    def command(self, request: EnvRequest, bundle: Path) -> list[str]:
        runsc = self._runsc(
            f"--platform={self.platform}",
            "--network=none",
            "--host-uds=open",
            "--overlay2=root:memory",
            "--cpu-num-from-quota",
            "run",
            f"--bundle={bundle}",
            hostproc.marker(request.env_id),
        )
        return hostproc.supervised(runsc, request.hard_deadline_s)

    async def create(self, request: EnvRequest) -> Env:
        refuse_network(self, request)
        runsc_version()
        rootfs = await bundle_mod.ensure_tree(request.baseline)
        env_id = request.env_id
        ctl_dir = sockets.make_env_dir(env_id)  # a short path whatever the home's length
        run_dir = self.run_dir(env_id)
        run_dir.mkdir(parents=True, mode=0o700)
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if not connected.done():
                connected.set_result((reader, writer))
            else:  # only the first connection is the agent
                writer.close()

        server: asyncio.Server | None = None
        try:
            self.runsc_root.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_owner(run_dir, request, self.name)
            bundle = run_dir / hostproc.marker(env_id)
            spec = bundle_mod.oci_spec(request, rootfs, ctl_dir, hostproc.marker(env_id))
            bundle_mod.write_bundle(bundle, spec)
            sock = str(ctl_dir / bundle_mod.SOCKET_NAME)
            server = await asyncio.start_unix_server(on_connect, sock, limit=1 << 22)
            started = time.monotonic()
            self.groups.create(env_id)
            argv = self.groups.wrap(env_id, self.command(request, bundle))
            proc, console_fd = await hostproc.spawn_with_console(argv)
        except BaseException as exc:
            if server is not None:
                server.close()
            await asyncio.shield(self.destroy(env_id))
            if isinstance(exc, OSError):
                raise LaunchError(f"cannot start runsc: {exc}") from exc
            raise
        live = _Live(proc, console_fd)
        self._live[env_id] = live
        live.pump = asyncio.create_task(live.read_console())
        try:
            (run_dir / "pid").write_text(str(proc.pid))
            session = await asyncio.wait_for(self._connect(live, connected), self.ready_timeout_s)
        except BaseException as exc:
            if connected.done() and not connected.cancelled():
                connected.result()[1].close()  # a connection that came too late
            await fail_launch(
                self.destroy,
                env_id,
                live.console_tail(),
                exc,
                self.ready_timeout_s,
                "sandbox start",
            )
        finally:
            server.close()
        info = EnvInfo(
            env_id=env_id,
            driver=self.name,
            accelerator=self.accelerator,
            isolation=ISOLATION,
            pid=proc.pid,
            run_dir=run_dir,
            created_at=time.time(),
            ready_s=time.monotonic() - started,
            jail=self.groups.jail(env_id),
        )
        return Env(self, info, session)

    async def _connect(
        self,
        live: _Live,
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    ) -> AgentConnection:
        """Wait for the agent's connection and HELLO, failing early if runsc exits."""
        exit_task = asyncio.ensure_future(live.proc.wait())
        try:
            await self._first(connected, exit_task, live)
            reader, writer = connected.result()
            session = AgentConnection(reader, writer)
            hello_task = asyncio.ensure_future(session.wait_hello())
            try:
                await self._first(hello_task, exit_task, live)
                hello_task.result()
            except BaseException:
                hello_task.cancel()
                await asyncio.gather(hello_task, return_exceptions=True)
                await session.aclose()
                raise
            return session
        finally:
            exit_task.cancel()
            await asyncio.gather(exit_task, return_exceptions=True)

    @staticmethod
    async def _first(
        wanted: asyncio.Future[Any], exit_task: asyncio.Future[int], live: _Live
    ) -> None:
        """Wait for ``wanted``; raise LaunchError if runsc exits first."""
        await asyncio.wait({wanted, exit_task}, return_when=asyncio.FIRST_COMPLETED)
        if not wanted.done():
            raise LaunchError(f"runsc exited with status {live.proc.returncode} at start")

    async def destroy(self, env_id: str) -> DestroyReport:
        start = time.perf_counter()
        live = self._live.get(env_id)
        attempts, left = 0, ["not checked"]
        for attempts in range(1, 6):
            await self._kill(env_id, live)
            await self._delete_state(env_id)
            for leaf in bundle_mod.cgroup_leaves(hostproc.marker(env_id)):
                with contextlib.suppress(OSError):
                    leaf.rmdir()
            sockets.remove_env_dir(env_id)
            hostproc.remove_tree(self.run_dir(env_id))
            await self.groups.remove(env_id)
            left = self.remains(env_id)
            if not left:
                break
            await asyncio.sleep(0.01 * 2**attempts)
        if live is not None and live.pump is not None:
            live.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await live.pump
        self._live.pop(env_id, None)
        elapsed_ms = (time.perf_counter() - start) * 1000
        return DestroyReport(env_id, not left, attempts, elapsed_ms, detail="; ".join(left))

    async def _call(self, *args: str) -> int | None:
        """Run ``runsc --root=… args`` quietly; its exit status (None if it hung)."""
        proc = await asyncio.create_subprocess_exec(
            *self._runsc(*args),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            return await asyncio.wait_for(proc.wait(), RUNSC_CALL_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return None

    async def _kill(self, env_id: str, live: _Live | None) -> None:
        """End the sandbox: it usually exits by itself once the agent's channel is closed;
        else ``runsc kill``; else SIGKILL of the supervisor group (the sandbox is attached)."""
        cid = hostproc.marker(env_id)
        if live is not None and live.proc.returncode is None:
            if not await _exited(live.proc, EXIT_WAIT_S) and self._state_files(cid):
                await self._call("kill", cid, "KILL")
            if not await _exited(live.proc, GRACE_S):
                hostproc.kill_group(live.proc.pid, signal.SIGKILL)
                await live.proc.wait()
        self.groups.kill(env_id)  # the sandbox, gofer and stubs are in its cgroup
        pids = cgroups.own_pids_with_marker(env_id)  # strays of ours (an older version's)
        if pids:
            cgroups.pidfd_kill(pids)
            await hostproc.wait_gone(pids, 2.0)

    async def _delete_state(self, env_id: str) -> None:
        cid = hostproc.marker(env_id)
        if self._state_files(cid):
            await self._call("delete", "--force", cid)
        for path in self._state_files(cid):  # runsc could not (e.g. a corrupt state file)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _state_files(self, cid: str) -> list[Path]:
        try:
            return [p for p in self.runsc_root.iterdir() if cid in p.name]
        except FileNotFoundError:
            return []

    def remains(self, env_id: str) -> list[str]:
        """What is left of an env on the host (empty when it is confirmed absent)."""
        cid = hostproc.marker(env_id)
        left = []
        if self.run_dir(env_id).exists():
            left.append("run folder")
        if sockets.env_dir(env_id).exists():
            left.append("socket folder")
        if pids := self.groups.pids(env_id) or cgroups.own_pids_with_marker(env_id):
            left.append(f"processes {pids}")
        if self._state_files(cid):
            left.append("runsc state")
        if bundle_mod.cgroup_leaves(cid) or self.groups.exists(env_id):
            left.append("cgroup")
        return left

    def exists(self, env_id: str) -> bool:
        return bool(self.remains(env_id))

    def list_owned(self) -> list[str]:
        """Envs of this driver and run folder: processes (sandbox, gofer, stubs name the
        runsc root or the bundle) of ours, identity cgroups, runsc state, run folders."""
        found = self.groups.listed()
        found |= hostproc.env_ids_running(b"runsc", str(self.run_root).encode(), owned=jail.ours)
        found |= hostproc.env_ids_running(b"runsc", str(self.runsc_root).encode(), owned=jail.ours)
        with contextlib.suppress(FileNotFoundError):
            for path in self.runsc_root.iterdir():
                match = hostproc.ENV_ID_RE.search(path.name.encode())
                if match:
                    found.add(match.group(1).decode())
        with contextlib.suppress(FileNotFoundError):
            found.update(p.name for p in self.run_root.iterdir() if p.name.startswith("env-"))
        return sorted(found)


async def _exited(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``proc`` to exit; True if it did."""
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
