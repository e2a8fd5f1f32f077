"""The qemu driver: one ``-M microvm`` QEMU process per environment.

Per env: a run folder ``$CLEANROOM_HOME/run/<env_id>/`` (owner.json, pid, the agent socket and
the QMP socket); the baseline's root image as a read-only virtio-blk disk; no network device;
the agent on a virtio-serial port; the serial console piped to the driver, which keeps a
bounded tail for diagnostics. The process runs under ``hostproc.supervised`` so it dies with
its controller and at its hard deadline. destroy = SIGTERM, then SIGKILL, reap, remove the
run folder, then confirm that neither a process nor the folder remains.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import time
from pathlib import Path
from typing import Any

from cleanroom import paths
from cleanroom.agent.session import AgentSession
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers import hostproc
from cleanroom.drivers.base import (
    DestroyReport,
    Driver,
    Env,
    EnvInfo,
    EnvRequest,
    read_owner,
    write_owner,
)
from cleanroom.errors import DriverError, LaunchError

CONSOLE_TAIL_BYTES = 64 * 1024
GRACE_S = 0.1
GUEST_CMDLINE = (
    "console=ttyS0 quiet panic=-1 reboot=t tsc=reliable tsc_early_khz={khz} "
    "cryptomgr.notests random.trust_cpu=on mitigations=off nokaslr 8250.nr_uarts=1 "
    "initcall_blacklist=init_kprobe_trace,load_system_certificate_list"
)


class _Live:
    """What the driver holds for an env it created in this process."""

    def __init__(self, proc: asyncio.subprocess.Process, run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.console: collections.deque[bytes] = collections.deque()
        self.console_size = 0
        self.pump: asyncio.Task[None] | None = None

    async def read_console(self) -> None:
        assert self.proc.stdout is not None
        while chunk := await self.proc.stdout.read(4096):
            self.console.append(chunk)
            self.console_size += len(chunk)
            while self.console_size > CONSOLE_TAIL_BYTES and len(self.console) > 1:
                self.console_size -= len(self.console.popleft())

    def console_tail(self) -> bytes:
        return b"".join(self.console)[-CONSOLE_TAIL_BYTES:]


class QemuDriver(Driver):
    """Fresh microVMs from a baseline's kernel, initramfs and read-only root image."""

    name = "qemu"
    capabilities = frozenset({"exec", "files", "console"})

    def __init__(self, *, boot_timeout_s: float = 90.0, run_root: Path | None = None) -> None:
        self.boot_timeout_s = boot_timeout_s
        self.run_root = run_root or paths.run_dir() / self.name
        self._live: dict[str, _Live] = {}
        self.accel: accel_mod.Accel | None = None

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

    def command(self, request: EnvRequest, accel: accel_mod.Accel, run_dir: Path) -> list[str]:
        b, lim = request.baseline, request.limits
        qemu = [
            accel_mod.QEMU,
            "-name",
            hostproc.marker(request.env_id),
            "-M",
            "microvm,x-option-roms=off,isa-serial=on,rtc=on,pit=on",
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
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
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
            "-chardev",
            f"socket,id=ctl,path={run_dir / 'ctl.sock'},server=on,wait=off",
            "-device",
            "virtserialport,chardev=ctl,name=ctl",
            "-qmp",
            f"unix:{run_dir / 'qmp.sock'},server=on,wait=off",
        ]
        return hostproc.supervised(qemu, request.hard_deadline_s)

    async def create(self, request: EnvRequest) -> Env:
        if self.accel is None:
            self.accel = await accel_mod.choose(request.baseline)
        accel = self.accel
        run_dir = self.run_dir(request.env_id)
        run_dir.mkdir(parents=True, mode=0o700)
        write_owner(run_dir, request, self.name)
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command(request, accel, run_dir),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            hostproc.remove_tree(run_dir)
            raise LaunchError(f"cannot start QEMU: {exc}") from exc
        live = _Live(proc, run_dir)
        self._live[request.env_id] = live
        live.pump = asyncio.create_task(live.read_console())
        (run_dir / "pid").write_text(str(proc.pid))
        try:
            session = await asyncio.wait_for(self._connect(live), self.boot_timeout_s)
        except BaseException as exc:
            tail = live.console_tail().decode(errors="replace")[-800:]
            await asyncio.shield(self.destroy(request.env_id))
            if isinstance(exc, TimeoutError):
                raise LaunchError(
                    f"guest agent not ready within {self.boot_timeout_s:.0f}s; console:\n{tail}"
                ) from exc
            if isinstance(exc, DriverError):
                raise LaunchError(f"{exc}; console:\n{tail}") from exc
            raise
        info = EnvInfo(
            env_id=request.env_id,
            driver=self.name,
            accelerator=accel.name,
            isolation=accel.isolation,
            pid=proc.pid,
            run_dir=run_dir,
            created_at=time.time(),
            ready_s=time.monotonic() - started,
        )
        return Env(self, info, session)

    async def _connect(self, live: _Live) -> AgentSession:
        sock = live.run_dir / "ctl.sock"
        delay = 0.002
        while True:
            if live.proc.returncode is not None:
                raise LaunchError(f"QEMU exited with status {live.proc.returncode} during boot")
            if sock.exists():
                try:
                    reader, writer = await asyncio.open_unix_connection(str(sock), limit=1 << 22)
                    break
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        session = AgentSession(reader, writer)
        hello_task = asyncio.ensure_future(session.wait_hello())
        exit_task = asyncio.ensure_future(live.proc.wait())
        try:
            done, _ = await asyncio.wait(
                {hello_task, exit_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if hello_task not in done:
                raise LaunchError(f"QEMU exited with status {live.proc.returncode} during boot")
            hello_task.result()
        except BaseException:
            await session.aclose()
            raise
        finally:
            for task in (hello_task, exit_task):
                task.cancel()
            await asyncio.gather(hello_task, exit_task, return_exceptions=True)
        return session

    async def destroy(self, env_id: str) -> DestroyReport:
        start = time.perf_counter()
        live = self._live.get(env_id)
        attempts = 0
        for attempts in range(1, 6):
            await self._kill(env_id, live)
            hostproc.remove_tree(self.run_dir(env_id))
            if not self.exists(env_id):
                break
            await asyncio.sleep(0.01 * 2**attempts)
        if live is not None and live.pump is not None:
            live.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await live.pump
        self._live.pop(env_id, None)
        gone = not self.exists(env_id)
        return DestroyReport(env_id, gone, attempts, (time.perf_counter() - start) * 1000)

    async def _kill(self, env_id: str, live: _Live | None) -> None:
        if live is not None and live.proc.returncode is None:
            hostproc.kill_group(live.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(live.proc.wait(), GRACE_S)
            except TimeoutError:
                hostproc.kill_group(live.proc.pid, signal.SIGKILL)
                await live.proc.wait()
        pids = hostproc.pids_with_marker(env_id)  # strays, or an env another controller made
        if pids:
            hostproc.kill_pids(pids, signal.SIGKILL)
            await hostproc.wait_gone(pids, 2.0)

    def exists(self, env_id: str) -> bool:
        return self.run_dir(env_id).exists() or bool(hostproc.pids_with_marker(env_id))

    def alive(self, env_id: str) -> bool:
        live = self._live.get(env_id)
        if live is not None:
            return live.proc.returncode is None
        return bool(hostproc.pids_with_marker(env_id))

    def list_owned(self) -> list[str]:
        found = hostproc.env_ids_running()
        if self.run_root.is_dir():
            found.update(p.name for p in self.run_root.iterdir() if p.name.startswith("env-"))
        return sorted(found)

    def owner_of(self, env_id: str) -> dict[str, Any] | None:
        return read_owner(self.run_dir(env_id))

    def diagnostics(self, env_id: str) -> dict[str, bytes]:
        live = self._live.get(env_id)
        return {"console.log": live.console_tail()} if live is not None else {}
