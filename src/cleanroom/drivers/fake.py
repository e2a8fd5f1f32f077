"""The fake driver: the real guest agent as a plain host process. No isolation at all.

Shipped like httpx's MockTransport: for fast tests of the controller and for trying the API
without QEMU. The agent (the native one, compiled by the host's gcc: ``native.host_binary``),
its protocol and the host session are the real ones; only the VM is missing.
``/run/cleanroom`` is relocated to ``<run_dir>/root/run/cleanroom`` and entrypoints run on the
host, so a baseline used with it should name a host command as its entrypoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from cleanroom.agent import native
from cleanroom.agent.connection import AgentConnection
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers import sockets
from cleanroom.drivers.base import (
    Capabilities,
    DestroyReport,
    Env,
    EnvInfo,
    EnvRequest,
    RunFolderDriver,
    refuse_network,
    write_owner,
)
from cleanroom.errors import LaunchError
from cleanroom.host import cgroups, hostproc, paths


def agent_argv(baseline: Baseline, marker: str) -> list[str]:
    """The agent of an env: the native one, built by the host's gcc (``native.host_binary``)."""
    return [str(native.host_binary()), marker]


class FakeDriver(RunFolderDriver):
    name = "fake"
    groups: cgroups.EnvGroups
    capabilities = Capabilities()

    def __init__(self, *, run_root: Path | None = None, ready_timeout_s: float = 10.0) -> None:
        self.run_root = run_root or paths.run_dir() / self.name
        self.ready_timeout_s = ready_timeout_s
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        # the agent runs on the host: no console to keep
        self._live: dict[str, hostproc.ConsoleProcess] = {}
        scope = cgroups.scope_of(self.name, self.run_root)  # identity: as qemu's (cgroups.py)
        self.groups = cgroups.EnvGroups(cgroups.detect(), scope)

    def describe(self) -> dict[str, str]:
        return {
            "driver": self.name,
            "accelerator": "none",
            "accelerator_version": "none (host process)",
            "isolation": "none",
        }

    def run_dir(self, env_id: str) -> Path:
        return self.run_root / env_id

    def guest_prefix(self, env_id: str) -> str:
        """Where this env's ``/`` is on the host (its agent keeps ``/run/cleanroom`` there).

        Checks and verifiers that put files into an env prefix guest paths with this; a VM
        driver has no such method (the guest's ``/`` is its own).
        """
        return str(self.run_dir(env_id) / "root")

    async def create(self, request: EnvRequest) -> Env:
        refuse_network(self, request)
        sock_path = (
            sockets.make_env_dir(request.env_id) / "ctl.sock"
        )  # refused before any run folder
        run_dir = self.run_dir(request.env_id)
        run_dir.mkdir(parents=True, mode=0o700)
        write_owner(run_dir, request, self.name)
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if not connected.done():
                connected.set_result((reader, writer))

        argv = agent_argv(request.baseline, hostproc.marker(request.env_id))  # no gcc: refused
        server = await asyncio.start_unix_server(on_connect, str(sock_path), limit=1 << 22)
        started = time.monotonic()
        env = {
            **os.environ,
            "CLEANROOM_AGENT_SOCKET": str(sock_path),
            "CLEANROOM_GUEST_ROOT": str(run_dir / "root"),
            "CLEANROOM_PYTHON": sys.executable,  # the gym process's (has the host's gymnasium)
        }
        self.groups.create(request.env_id)
        proc = await asyncio.create_subprocess_exec(
            *self.groups.wrap(request.env_id, hostproc.supervised(argv, request.hard_deadline_s)),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        self._procs[request.env_id] = proc
        try:
            reader, writer = await asyncio.wait_for(connected, self.ready_timeout_s)
            session = AgentConnection(reader, writer)
            await asyncio.wait_for(session.wait_hello(), self.ready_timeout_s)
        except BaseException as exc:
            await asyncio.shield(self.destroy(request.env_id))
            if isinstance(exc, Exception):
                raise LaunchError(f"fake agent did not start: {exc!r}") from exc
            raise
        finally:
            server.close()
        info = EnvInfo(
            env_id=request.env_id,
            driver=self.name,
            accelerator="none",
            isolation="none",
            pid=proc.pid,
            run_dir=run_dir,
            created_at=time.time(),
            ready_s=time.monotonic() - started,
            jail=self.groups.jail(request.env_id),
        )
        return Env(self, info, session)

    async def destroy(self, env_id: str) -> DestroyReport:
        start = time.perf_counter()
        proc = self._procs.pop(env_id, None)
        killed: list[int] = []
        if proc is not None and proc.returncode is None:
            killed = await self._kill_tree(proc.pid)
            hostproc.kill_group(proc.pid, signal.SIGKILL)
            await proc.wait()
        self.groups.kill(env_id)
        strays = cgroups.own_pids_with_marker(env_id)  # never another user's (issue 15 §6)
        hostproc.kill_pids(killed, signal.SIGKILL)
        cgroups.pidfd_kill(strays)
        pids = killed + strays
        tree_gone = await hostproc.wait_gone(pids, 2.0)
        sockets.remove_env_dir(env_id)
        hostproc.remove_tree(self.run_dir(env_id))
        removed = await self.groups.remove(env_id)
        gone = tree_gone and removed and not self.exists(env_id)
        return DestroyReport(env_id, gone, 1, (time.perf_counter() - start) * 1000)

    @staticmethod
    async def _kill_tree(root: int) -> list[int]:
        """Kill everything below the agent, which is frozen (and a subreaper) meanwhile.

        The entrypoint runs in its own session, so the agent's group is not enough. With the
        agent stopped nothing new is spawned, and whatever a killed process leaves orphaned is
        reparented to the (still living) agent, so repeating the sweep catches it too.
        """
        hostproc.kill_group(root, signal.SIGSTOP)
        killed: list[int] = []
        for _ in range(20):
            tree = [p for p in hostproc.descendants(root) if hostproc.pid_alive(p)]
            if not tree:
                break
            hostproc.kill_pids(tree, signal.SIGKILL)
            killed += tree
            await hostproc.wait_gone(tree, 0.5)
        return killed

    def exists(self, env_id: str) -> bool:
        return (
            self.run_dir(env_id).exists()
            or sockets.env_dir(env_id).exists()
            or self.groups.exists(env_id)
            or bool(cgroups.own_pids_with_marker(env_id))
        )

    def alive(self, env_id: str) -> bool:
        proc = self._procs.get(env_id)
        return proc is not None and proc.returncode is None

    def list_owned(self) -> list[str]:
        found = self.groups.listed()
        with contextlib.suppress(FileNotFoundError):
            found.update(p.name for p in self.run_root.iterdir() if p.name.startswith("env-"))
        return sorted(found)
