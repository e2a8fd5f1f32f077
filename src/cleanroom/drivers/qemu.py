"""The qemu driver: one ``-M microvm`` QEMU process per environment.

Per env: a run folder ``$CLEANROOM_HOME/run/<env_id>/`` (owner.json, pid, the QMP socket); the
baseline's root image as a read-only virtio-blk disk; no network device (with an egress
allowlist: a restricted user-mode network whose only exits lead to the env's egress proxy,
``cleanroom.network.qemu_args``; such VMs always boot cold); the agent on a virtio-serial port
whose host side is one end of a socket pair the driver made (connected before QEMU starts:
nothing to wait for or poll); the serial console piped to the driver, which keeps a bounded
tail for diagnostics. The process runs under ``hostproc.supervised`` so it dies with its
controller and at its hard deadline. destroy = SIGKILL the process group, reap, remove the run
folder, then confirm (one /proc scan) that neither a process nor the folder remains.

Starts (``QemuDriver(start=...)``, default ``$CLEANROOM_QEMU_START`` or ``auto``): ``cold``
boots the kernel every time; ``snapshot`` restores a clone of the baseline's template
(``snapshot.py``: built on first use by booting the baseline once with its RAM in a file and
saving it); ``auto`` is ``snapshot``, falling back to a cold boot, with the reason recorded in
``EnvInfo.start_note``, if the template cannot be built or a clone cannot be restored (after a
failed build, or 3 failed restores in a row, it boots cold for 5 minutes before trying again).
A clone is a new QEMU process with the template's devices, its RAM mapped copy-on-write from
the template's RAM file, ``-incoming defer`` and a second monitor (a socket pair) that already
holds the commands loading the device state (``migrate-incoming fd:N``, the state file
inherited); it runs once loaded. When the monitor has accepted them the driver queues RESEED
(host entropy, the env id, the wall clock) on the agent channel, and the clone is ready when
the agent answers with HELLO. Clones and the template's build VM carry the same
``cleanroom-<env_id>`` marker and run folder as a cold VM, so destroy, confirm and reap treat
them alike. Fork (a warm env saved, clones restored from it, for groups) lives in
``qemu_fork.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import signal
import socket
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from cleanroom import paths
from cleanroom.agent import protocol
from cleanroom.agent.session import AgentSession
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers import hostproc, qemu_fork, qmp, snapshot
from cleanroom.drivers.base import (
    DestroyReport,
    Env,
    EnvInfo,
    EnvRequest,
    ForkSnapshot,
    RunFolderDriver,
    fail_launch,
    new_env_id,
    write_owner,
)
from cleanroom.drivers.qmp import QmpClient
from cleanroom.errors import CleanroomError, ConfigError, DriftError, DriverError, LaunchError
from cleanroom.network import qemu_args as net_args

MACHINE = "microvm,x-option-roms=off,isa-serial=on,rtc=on,pit=on"
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
STARTS = ("auto", "cold", "snapshot")
START_ENV = "CLEANROOM_QEMU_START"  # the default of ``QemuDriver(start=...)``
MAX_RESTORE_FAILURES = 3  # clones of one template failing in a row: treat it as failed
RESEED_BYTES = 64
TEMPLATE_RETRY_S = 300.0  # after a failed template build, cold boots until then (auto)
# clearcpuid=erms,rep_good: the kernel copies and clears memory with unrolled loops instead of
# `rep movs/stos`, which TCG runs one iteration per step: ~10% less CPU for a cold boot and a
# clone's first steps (A/B, QEMU CPU time). It marks the guest kernel tainted 'S' (cosmetic).
GUEST_CMDLINE = (
    "console=ttyS0 quiet panic=-1 reboot=t tsc=reliable tsc_early_khz={khz} "
    "cryptomgr.notests random.trust_cpu=on mitigations=off nokaslr 8250.nr_uarts=1 "
    "initcall_blacklist=init_kprobe_trace,load_system_certificate_list "
    "clearcpuid=erms,rep_good"
)


class _Live(hostproc.ConsoleProcess):
    """What the driver holds for an env it created in this process."""

    def __init__(
        self, proc: asyncio.subprocess.Process, run_dir: Path, channel: socket.socket
    ) -> None:
        super().__init__(proc)
        self.run_dir = run_dir
        self.channel: socket.socket | None = channel  # the agent channel until it is opened
        self.qmp: QmpClient | None = None


class QemuDriver(RunFolderDriver):
    """Fresh microVMs from a baseline's kernel, initramfs and read-only root image."""

    name = "qemu"
    capabilities = frozenset({"exec", "files", "console", "snapshot", "egress", "fork"})

    def __init__(
        self,
        *,
        boot_timeout_s: float = 90.0,
        run_root: Path | None = None,
        start: str | None = None,
        restore_timeout_s: float = 30.0,
    ) -> None:
        start = start or os.environ.get(START_ENV, "auto").strip().lower() or "auto"
        if start not in STARTS:
            raise ConfigError(f"start must be one of {', '.join(STARTS)} (not {start!r})")
        self.boot_timeout_s = boot_timeout_s
        self.restore_timeout_s = restore_timeout_s
        self.start = start
        self.run_root = run_root or paths.run_dir() / self.name
        self._live: dict[str, _Live] = {}
        self.accel: accel_mod.Accel | None = None
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._template_failed: dict[str, tuple[float, str]] = {}  # key -> (when, why)
        self._restore_failures: dict[str, int] = {}  # key -> clones that failed in a row

    def run_dir(self, env_id: str) -> Path:
        return self.run_root / env_id

    def describe(self) -> dict[str, str]:
        if self.accel is None:
            return {"driver": self.name}
        return {
            "driver": self.name,
            "accelerator": self.accel.name,
            "accelerator_version": f"qemu {self.accel.qemu_version}",
            "isolation": self.accel.isolation,
        }

    def machine_args(
        self, request: EnvRequest, accel: accel_mod.Accel, *, memory_backend: bool = False
    ) -> list[str]:
        """The machine and its devices: identical for a template and its clones."""
        b, lim = request.baseline, request.limits
        return [
            "-M",
            MACHINE + (",memory-backend=mem" if memory_backend else ""),
            *accel.qemu_args(),
            "-m",
            str(lim.memory_mib),
            "-smp",
            str(lim.vcpus),
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-sandbox",
            SANDBOX if request.network is None else net_args.SANDBOX_NETWORKED,
            "-serial",
            "stdio",
            "-kernel",
            str(b.kernel),
            "-initrd",
            str(b.initrd),
            "-append",
            GUEST_CMDLINE.format(khz=accel_mod.host_tsc_khz()),
            "-drive",
            f"id=root,file={b.rootfs},format=raw,if=none,readonly=on",
            "-device",
            "virtio-blk-device,drive=root",
            "-device",
            "virtio-serial-device",
            "-device",
            "virtserialport,chardev=ctl,name=ctl",
            *(net_args.netdev_args(request.network) if request.network else []),
        ]

    def command(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        run_dir: Path,
        extra: list[str] | None = None,
        *,
        ctl_fd: int,
        memory_backend: bool = False,
    ) -> list[str]:
        qemu = [
            accel_mod.QEMU,
            "-name",
            hostproc.marker(request.env_id),
            *self.machine_args(request, accel, memory_backend=memory_backend),
            "-chardev",
            f"socket,id=ctl,fd={ctl_fd}",  # the guest's end of the agent channel's socket pair
            "-qmp",
            f"unix:{snapshot.qemu_opt(run_dir / 'qmp.sock')},server=on,wait=off",
            *(extra or []),
        ]
        return hostproc.supervised(qemu, request.hard_deadline_s)

    async def create(self, request: EnvRequest) -> Env:
        if self.accel is None:
            self.accel = await accel_mod.choose(request.baseline)
        accel = self.accel
        started = time.monotonic()
        note: str | None = None
        if request.network is not None and self.start != "cold":
            note = "egress needs a NIC and snapshot templates have none: booted cold"
        elif self.start != "cold":
            try:
                template, note = await self.template_for(request, accel)
                return await self._clone(request, accel, template, started, note)
            except (CleanroomError, OSError) as exc:  # OSError: e.g. template removed under us
                self._count_restore_failure(request, accel, exc)
                if self.start == "snapshot":
                    if isinstance(exc, LaunchError):
                        raise
                    raise LaunchError(f"snapshot start failed: {exc}") from exc
                note = f"snapshot start failed, booted cold: {_first_line(exc)}"
        return await self._cold(request, accel, started, note)

    def _count_restore_failure(
        self, request: EnvRequest, accel: accel_mod.Accel, exc: Exception
    ) -> None:
        """After MAX_RESTORE_FAILURES clones of a template failed in a row, stop using it
        for TEMPLATE_RETRY_S (auto: cold boots; a timed-out restore is expensive)."""
        if not isinstance(exc, LaunchError | OSError):
            return  # the template itself is missing or failed to build: already recorded
        key = self.template_key(request, accel)
        failures = self._restore_failures.get(key, 0) + 1
        self._restore_failures[key] = failures
        if failures >= MAX_RESTORE_FAILURES:
            why = f"{failures} clones in a row failed to restore; last: {_first_line(exc)}"
            self._template_failed[key] = (time.monotonic(), why)
            self._restore_failures[key] = 0

    async def _spawn(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        extra: list[str] | None = None,
        *,
        pass_fds: tuple[int, ...] = (),
        memory_backend: bool = False,
    ) -> _Live:
        """Start the env's QEMU process (run folder first: owner, then the process, its pid)."""
        run_dir = self.run_dir(request.env_id)
        run_dir.mkdir(parents=True, mode=0o700)
        write_owner(run_dir, request, self.name)
        channel, guest_end = socket.socketpair()
        argv = self.command(
            request, accel, run_dir, extra, ctl_fd=guest_end.fileno(), memory_backend=memory_backend
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(*pass_fds, guest_end.fileno()),
            )
        except OSError as exc:
            channel.close()
            hostproc.remove_tree(run_dir)
            raise LaunchError(f"cannot start QEMU: {exc}") from exc
        finally:
            guest_end.close()
        live = _Live(proc, run_dir, channel)
        self._live[request.env_id] = live
        live.pump = asyncio.create_task(live.read_console())
        (run_dir / "pid").write_text(str(proc.pid))
        return live

    async def _ready_or_destroy(
        self,
        env_id: str,
        live: _Live,
        ready: Awaitable[AgentSession],
        timeout_s: float,
        what: str,
    ) -> AgentSession:
        """Await ``ready`` within ``timeout_s``; on any failure destroy the env, then raise."""
        try:
            return await asyncio.wait_for(ready, timeout_s)
        except BaseException as exc:
            await fail_launch(self, env_id, live.console_tail(), exc, timeout_s, what)

    async def _cold(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        started: float,
        note: str | None,
        extra: list[str] | None = None,
        *,
        memory_backend: bool = False,
    ) -> Env:
        live = await self._spawn(request, accel, extra, memory_backend=memory_backend)
        session = await self._ready_or_destroy(
            request.env_id, live, self._connect(live), self.boot_timeout_s, "boot"
        )
        return Env(self, self._info(request, accel, live, started, start_note=note), session)

    def _info(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        live: _Live,
        started: float,
        **start: Any,
    ) -> EnvInfo:
        return EnvInfo(
            env_id=request.env_id,
            driver=self.name,
            accelerator=accel.name,
            isolation=accel.isolation,
            pid=live.proc.pid,
            run_dir=live.run_dir,
            created_at=time.time(),
            ready_s=time.monotonic() - started,
            **start,
        )

    # -- snapshot starts ------------------------------------------------------------------------

    def template_key(self, request: EnvRequest, accel: accel_mod.Accel) -> str:
        machine = self.machine_args(request, accel, memory_backend=True)
        return snapshot.template_key(request.baseline, accel.qemu_version, accel.name, machine)

    async def template_for(
        self, request: EnvRequest, accel: accel_mod.Accel
    ) -> tuple[snapshot.Template, str | None]:
        """The checked template for this request (built on first use), and a note if rebuilt."""
        key = self.template_key(request, accel)
        failed = self._template_failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < TEMPLATE_RETRY_S:
            raise DriverError(failed[1])
        note: str | None = None
        async with self._template_locks.setdefault(key, asyncio.Lock()):
            try:
                template = await asyncio.to_thread(snapshot.load, key)
            except DriftError as exc:
                note = f"template {key[:12]} was modified ({', '.join(exc.drifted)}); rebuilt"
                await asyncio.to_thread(snapshot.discard, key)
                template = None
            if template is not None:
                return template, note
            async with snapshot.build_lock(key, self.boot_timeout_s + snapshot.SAVE_TIMEOUT_S):
                template = await asyncio.to_thread(snapshot.load, key)  # another process?
                if template is None:
                    try:
                        template = await self._build_template(request, accel, key)
                    except CleanroomError as exc:
                        why = f"template build failed: {_first_line(exc)}"
                        self._template_failed[key] = (time.monotonic(), why)
                        raise DriverError(why) from exc
            return template, note

    async def _build_template(
        self, request: EnvRequest, accel: accel_mod.Accel, key: str
    ) -> snapshot.Template:
        """Boot the baseline with RAM in a file, prepare the agent, save, destroy the VM."""
        started = time.monotonic()
        build = dataclasses.replace(
            request,
            env_id=new_env_id(),
            hard_deadline_s=self.boot_timeout_s + snapshot.SAVE_TIMEOUT_S + 60,
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
            live = await self._spawn(
                build,
                accel,
                snapshot.memory_args(work / snapshot.RAM_FILE, memory, shared=True),
                memory_backend=True,
            )
            writer = await self._ready_template(live)
            try:
                live.qmp = await QmpClient.connect(live.run_dir / "qmp.sock")
                save_s = await snapshot.save(live.qmp, state_fd)
            finally:
                writer.close()
            boot_s = time.monotonic() - started - save_s
        except BaseException as exc:
            await asyncio.shield(self.destroy(build.env_id))
            await asyncio.to_thread(hostproc.remove_tree, work)
            if isinstance(exc, TimeoutError):
                raise DriverError(
                    f"template VM not ready within {self.boot_timeout_s:.0f}s"
                ) from exc
            if isinstance(exc, OSError):
                raise DriverError(f"template build failed: {exc}") from exc
            raise
        finally:
            os.close(state_fd)
        report = await self.destroy(build.env_id)
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
        }
        try:
            return await asyncio.to_thread(snapshot.seal, work, key, memory, facts)
        except OSError as exc:
            await asyncio.to_thread(hostproc.remove_tree, work)
            raise DriverError(f"cannot save the template: {exc}") from exc

    async def _ready_template(self, live: _Live) -> asyncio.StreamWriter:
        """Wait for the template VM's agent and tell it a snapshot follows (channel kept open)."""

        async def ready() -> asyncio.StreamWriter:
            reader, writer = await self._open_channel(live)
            session = AgentSession(reader, writer)
            await self._await_hello(live, session)  # closes the session if it fails
            try:
                if not snapshot.agent_supports_snapshots(session.hello):
                    version = session.hello.get("agent_version")
                    raise DriverError(f"the baseline's guest agent {version} predates snapshots")
                await snapshot.prepare(reader, writer)
            except BaseException:
                await session.aclose()
                raise
            return writer

        return await asyncio.wait_for(ready(), self.boot_timeout_s)

    async def _clone(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        template: snapshot.Template,
        started: float,
        note: str | None,
        *,
        ram: Path | None = None,
        shared: bool = False,
    ) -> Env:
        """Restore ``template`` (a fork parent maps its own copy of the RAM ``shared``)."""
        state_fd = os.open(template.state, os.O_RDONLY | os.O_CLOEXEC)
        monitor, guest_end = socket.socketpair()  # QEMU reads its load commands from it
        try:
            monitor.sendall(snapshot.restore_script(state_fd))
            memory = snapshot.memory_args(ram or template.ram, template.memory_mib, shared=shared)
            mon = [
                "-chardev",
                f"socket,id=load,fd={guest_end.fileno()}",
                "-mon",
                "chardev=load,mode=control",
            ]
            live = await self._spawn(
                request,
                accel,
                [*memory, "-incoming", "defer", *mon],
                pass_fds=(state_fd, guest_end.fileno()),
                memory_backend=True,
            )
            guest_end.close()
            session = await self._ready_or_destroy(
                request.env_id,
                live,
                self._restore(request.env_id, live, monitor),
                self.restore_timeout_s,
                "restore",
            )
        finally:
            os.close(state_fd)
            guest_end.close()
            monitor.close()
        self._restore_failures.pop(template.key, None)
        info = self._info(
            request,
            accel,
            live,
            started,
            start_kind="snapshot",
            template=template.digest,
            start_note=note,
        )
        return Env(self, info, session)

    async def _restore(self, env_id: str, live: _Live, monitor: socket.socket) -> AgentSession:
        """Once the monitor accepted the load, queue RESEED; wait for the clone's HELLO."""
        mon_reader, mon_writer = await asyncio.open_unix_connection(sock=monitor)
        try:
            answers = qmp.read_answers(mon_reader, snapshot.RESTORE_COMMANDS)
            await self._while_running(live, answers)
        finally:
            mon_writer.close()
        reader, writer = await self._open_channel(live)
        header = {"clone_id": env_id, "time_ns": time.time_ns()}
        writer.write(
            protocol.encode(protocol.Kind.RESEED, header, secrets.token_bytes(RESEED_BYTES))
        )
        session = AgentSession(reader, writer)
        await self._await_hello(live, session)
        if session.hello.get("clone_id") != env_id:
            await session.aclose()
            raise DriverError(f"clone answered as {session.hello.get('clone_id')!r}, not {env_id}")
        return session

    # -- fork (qemu_fork.py) --------------------------------------------------------------------

    async def fork_parent(self, request: EnvRequest, snapshot_id: str) -> Env:
        return await qemu_fork.start_parent(self, request, snapshot_id)

    async def fork_save(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        return await qemu_fork.save(self, env, snapshot_id)

    async def fork_clone(self, request: EnvRequest, snap: ForkSnapshot) -> Env:
        return await qemu_fork.clone(self, request, snap)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        return await asyncio.to_thread(qemu_fork.delete, snapshot_id)

    def list_snapshots(self) -> list[str]:
        return qemu_fork.list_ids()

    def snapshot_owner(self, snapshot_id: str) -> dict[str, Any] | None:
        return qemu_fork.owner(snapshot_id)

    # -- the agent channel ----------------------------------------------------------------------

    async def _open_channel(self, live: _Live) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The host's end of the agent channel as streams (once: the streams then own it)."""
        channel, live.channel = live.channel, None
        if channel is None:
            raise DriverError("the agent channel was already opened")
        return await asyncio.open_unix_connection(sock=channel, limit=1 << 22)

    async def _connect(self, live: _Live) -> AgentSession:
        reader, writer = await self._open_channel(live)
        session = AgentSession(reader, writer)
        await self._await_hello(live, session)
        return session

    async def _await_hello(self, live: _Live, session: AgentSession) -> None:
        """Wait for HELLO, or fail as soon as QEMU exits; closes the session on failure."""
        try:
            await self._while_running(live, session.wait_hello())
        except BaseException:
            await session.aclose()
            raise

    async def _while_running(self, live: _Live, step: Awaitable[Any]) -> Any:
        """``step``'s result, or LaunchError as soon as QEMU exits before it is done."""
        step_task = asyncio.ensure_future(step)
        exit_task = asyncio.ensure_future(live.proc.wait())
        try:
            done, _ = await asyncio.wait(
                {step_task, exit_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if step_task not in done:
                raise LaunchError(f"QEMU exited with status {live.proc.returncode} during boot")
            return step_task.result()
        finally:
            for task in (step_task, exit_task):
                task.cancel()
            await asyncio.gather(step_task, exit_task, return_exceptions=True)

    async def destroy(self, env_id: str) -> DestroyReport:
        start = time.perf_counter()
        live = self._live.get(env_id)
        gone, attempts = False, 0
        for attempts in range(1, 6):
            gone = await self._kill_and_confirm(env_id, live)
            if gone:
                break
            await asyncio.sleep(0.01 * 2**attempts)
        if live is not None and live.qmp is not None:
            await live.qmp.aclose()
            live.qmp = None
        if live is not None and live.channel is not None:
            live.channel.close()  # never opened (create failed before that)
            live.channel = None
        if live is not None and live.pump is not None:
            live.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await live.pump
        self._live.pop(env_id, None)
        return DestroyReport(env_id, gone, attempts, (time.perf_counter() - start) * 1000)

    async def _kill_and_confirm(self, env_id: str, live: _Live | None) -> bool:
        """SIGKILL the env's process group, remove its run folder, then one /proc scan.

        No graceful SIGTERM first: the guest's state is disposable (read-only disk, RAM
        overlay) and a dying QEMU needs no CPU time to die on SIGKILL, whereas on SIGTERM it
        must be scheduled, which with dozens of busy VMs on two cores costs tens of ms. The
        scan is the proof: True only if no process carries the env's marker and no folder is
        left; strays it finds (an env another controller made) are SIGKILLed for the next try.
        """
        if live is not None and live.proc.returncode is None:
            hostproc.kill_group(live.proc.pid, signal.SIGKILL)
            await live.proc.wait()
        hostproc.remove_tree(self.run_dir(env_id))
        strays = hostproc.pids_with_marker(env_id)
        if strays:
            hostproc.kill_pids(strays, signal.SIGKILL)
            await hostproc.wait_gone(strays, 2.0)
            return False
        return not self.run_dir(env_id).exists()

    def exists(self, env_id: str) -> bool:
        return self.run_dir(env_id).exists() or bool(hostproc.pids_with_marker(env_id))

    def list_owned(self) -> list[str]:
        # only this driver's VMs under this run folder (not gvisor's, not another config's)
        found = hostproc.env_ids_running(b"qemu-system", str(self.run_root).encode())
        if self.run_root.is_dir():
            found.update(p.name for p in self.run_root.iterdir() if p.name.startswith("env-"))
        return sorted(found)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
