"""Host process helpers shared by drivers: find env processes by marker, kill, wait, supervise.

Every env process carries a marker in its command line (``cleanroom-<env_id>``), so the host
itself, not the controller's memory, answers "is anything of this env still running?".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from cleanroom.errors import QuotaExceeded

T = TypeVar("T")

MARKER_PREFIX = "cleanroom-"
ENV_ID_RE = re.compile(rb"cleanroom-(env-[0-9a-f]{16})")


CONSOLE_TAIL_BYTES = 64 * 1024  # the console kept for diagnostics: its last 64 KiB
CONSOLE_RATE = 32 * 1024  # bytes/s read from a console at most, once its burst is spent
CONSOLE_BURST = 256 * 1024  # read at once: a boot's messages, a panic's trace
CONSOLE_TICK_S = 0.05  # the console is read this often (never per write of the guest)
_PIPE_READ = 64 * 1024


class Ring:
    """The last ``size`` bytes written to it, in a buffer of that fixed size, and how many
    bytes were written in all (``total``); ``alarm(total)`` is an event set once ``total``
    bytes were written (an episode's quota, charged with its console)."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.size = size
        self.total = 0
        self._alarm: tuple[int, asyncio.Event] | None = None

    def alarm(self, total: int | None) -> asyncio.Event:
        """An event set once ``total`` bytes in all were written (None: no alarm any more)."""
        event = asyncio.Event()
        self._alarm = (total, event) if total is not None else None
        if total is not None and self.total >= total:
            event.set()
        return event

    def write(self, data: bytes) -> None:
        view = memoryview(data)[-self.size :]
        pos = (self.total + len(data) - len(view)) % self.size
        first = min(len(view), self.size - pos)
        self.buf[pos : pos + first] = view[:first]
        self.buf[: len(view) - first] = view[first:]
        self.total += len(data)
        if self._alarm is not None and self.total >= self._alarm[0]:
            self._alarm[1].set()

    def tail(self) -> bytes:
        if self.total <= self.size:
            return bytes(self.buf[: self.total])
        pos = self.total % self.size
        return bytes(self.buf[pos:] + self.buf[:pos])


async def charged_to_console(
    console: Ring, quota_bytes: int, run: Callable[[Callable[[], int]], Awaitable[T]]
) -> T:
    """``run(charged)`` with the console's bytes from now on charged to ``quota_bytes``:
    ``charged()`` (what the console printed since) is counted with every frame of output, and
    a console that alone goes past the quota ends the run at once (``QuotaExceeded``), even
    from a guest that sends nothing else."""
    start = console.total
    over = console.alarm(start + quota_bytes + 1)
    step = asyncio.ensure_future(run(lambda: console.total - start))
    alarm = asyncio.ensure_future(over.wait())
    try:
        await asyncio.wait({step, alarm}, return_when=asyncio.FIRST_COMPLETED)
        if step.done():
            return step.result()
        printed = console.total - start
        raise QuotaExceeded(
            f"episode output exceeds its quota of {quota_bytes} bytes (console: {printed} bytes)"
        )
    finally:
        console.alarm(None)
        for task in (step, alarm):
            task.cancel()
        await asyncio.gather(step, alarm, return_exceptions=True)


async def spawn_with_console(
    argv: list[str], *, pass_fds: tuple[int, ...] = ()
) -> tuple[asyncio.subprocess.Process, int]:
    """Start ``argv`` in a new session (stdin /dev/null), its stdout and stderr into a pipe;
    the pipe's read end (non-blocking, for ``ConsoleProcess``) is returned with the process."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(read_end, False)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=write_end,
            stderr=write_end,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return proc, read_end


class ConsoleProcess:
    """A driver's child process whose console output is kept in a fixed ring (diagnostics).

    ``read_console`` (the pump) reads the console pipe every ``CONSOLE_TICK_S``, as much as a
    budget of ``CONSOLE_RATE`` bytes/s allows once ``CONSOLE_BURST`` is spent: a guest flooding
    its console finds the pipe full and waits (its own slowdown), and the controller wakes at
    the tick, never per byte the guest writes. Once the process has exited, what is left is
    read at once. ``console_bytes`` counts every byte
    read (recorded in provenance as ``console_bytes``).
    """

    def __init__(self, proc: asyncio.subprocess.Process, console_fd: int) -> None:
        self.proc = proc
        self.console = Ring(CONSOLE_TAIL_BYTES)
        self.pump: asyncio.Task[None] | None = None
        self._fd = console_fd

    @property
    def console_bytes(self) -> int:
        return self.console.total

    def _read(self, limit: int) -> bool:
        """Read up to ``limit`` bytes of what the pipe holds now; False at its end."""
        while limit > 0 and self._fd >= 0:
            try:
                data = os.read(self._fd, min(limit, _PIPE_READ))
            except BlockingIOError:
                return True
            if not data:
                return False
            self.console.write(data)
            limit -= len(data)
        return self._fd >= 0

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    async def read_console(self) -> None:
        rate, burst = CONSOLE_RATE, CONSOLE_BURST
        budget, last = float(burst), time.monotonic()
        try:
            while True:
                now = time.monotonic()
                budget, last = min(burst, budget + (now - last) * rate), now
                exited = self.proc.returncode is not None
                before = self.console.total
                if not self._read(1 << 30 if exited else int(budget)):
                    return
                budget -= self.console.total - before
                await asyncio.sleep(CONSOLE_TICK_S)
        finally:
            self._close()

    def console_tail(self) -> bytes:
        """The ring, after reading what the pipe holds now (at most a ring's worth: a panic's
        last words are there before the crash is noticed, the pump may not have woken yet)."""
        self._read(CONSOLE_TAIL_BYTES)
        return self.console.tail()


def marker(env_id: str) -> str:
    return MARKER_PREFIX + env_id


def _cmdlines() -> list[tuple[int, bytes]]:
    """(pid, command line) of every process; raw os.open/os.read, 3x faster than open()."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/cmdline", os.O_RDONLY)
        except OSError:
            continue
        try:
            out.append((int(name), _read_all(fd)))
        except OSError:
            continue
        finally:
            os.close(fd)
    return out


def _read_all(fd: int) -> bytes:
    chunks = [os.read(fd, 65536)]
    while len(chunks[-1]) == 65536:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks)


def pids_with_marker(env_id: str) -> list[int]:
    """Live (non-zombie) processes whose command line names this env."""
    needle = marker(env_id).encode()
    return [pid for pid, cmd in _cmdlines() if needle in cmd and pid != os.getpid()]


def env_ids_running(*needles: bytes, owned: Callable[[int | None], bool] | None = None) -> set[str]:
    """Env ids of every cleanroom env process on this host.

    ``needles`` keep only command lines that contain all of them (e.g. ``b"qemu-system"`` and
    the driver's run folder), so a driver lists its own envs, never another driver's or those
    of a controller configured with another run folder; ``owned`` only processes whose uid it
    accepts (``jail.ours``: the controller's, or a jail uid).
    """
    found: set[str] = set()
    for pid, cmd in _cmdlines():
        if pid == os.getpid() or not all(needle in cmd for needle in needles):
            continue
        if owned is not None and not owned(uid_of(pid)):
            continue
        match = ENV_ID_RE.search(cmd)
        if match:
            found.add(match.group(1).decode())
    return found


def uid_of(pid: int) -> int | None:
    """The uid a process runs as (None: it is gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` in the process tree (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    """True if the pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_pids(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


async def wait_gone(pids: list[int], timeout_s: float) -> bool:
    """Wait until none of ``pids`` is alive (zombies of other parents count as gone)."""
    end = time.monotonic() + timeout_s
    delay = 0.0005
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > end:
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


JAIL_BOUNDING_SET = "-all,+dac_override,+sys_chroot,+setuid,+setgid"  # a VMM until it drops
# a jailed VMM's deadline keeper is the first process of its own PID namespace (see supervised)
PID_NAMESPACE = ("unshare", "--pid", "--kill-child=KILL")


def supervised(
    argv: list[str], deadline_s: float, *, jailed: bool = False, parent: int | None = None
) -> list[str]:
    """Wrap argv so it dies with its parent and, at the latest, after ``deadline_s``.

    ``timeout -s KILL`` is a host-side hard deadline that needs no controller, and it gets
    SIGALRM as its parent-death signal (``setpriv --pdeathsig ALRM``): the death of the
    controller is its deadline, so it SIGKILLs its child and their process group at once. That
    holds for a child that changed its uid (a jailed QEMU's ``-runas``), whose own parent-death
    signal the kernel clears with the change; ``timeout`` stays root, which a jailed VMM cannot
    signal. The child also gets ``--pdeathsig KILL`` (kept if it never changes uid: it dies
    even with a SIGKILLed ``timeout``), and ``jailed``, a bounding set of only what it needs to
    chroot and drop to its jail uid (``JAIL_BOUNDING_SET``) and no inheritable capabilities.
    A controller killed after the fork but before ``setpriv`` set the signal would leave the
    chain to its hard deadline (a spare started just then outlived a SIGKILLed controller by
    that long), so once the signal is set a shell checks that its parent is still ``parent``
    (default: this process, the one that forks it) and starts nothing if not.

    A jailed child has lost its own parent-death signal, so ``timeout`` alone held it: a
    ``timeout`` SIGKILLed by someone else (Ray's worker exit kills its children) left the
    jailed QEMU re-parented to init, running past its deadline. So ``timeout`` runs as the
    first process of a PID namespace of its own (``unshare --pid --kill-child``): when it dies,
    for whatever reason, the kernel SIGKILLs every process in that namespace, whatever its uid;
    and ``unshare``, which holds the chain's parent-death signal now, SIGKILLs ``timeout`` when
    it dies itself. Whatever dies, the VMM dies by its deadline at the latest.
    """
    trim = [f"--bounding-set={JAIL_BOUNDING_SET}", "--inh-caps=-all"] if jailed else []
    anchor = [*PID_NAMESPACE, "--"] if jailed else []
    return [
        "setpriv",
        "--pdeathsig",
        "ALRM",
        "--",
        "/bin/sh",
        "-c",
        'test "$PPID" = "$0" && exec "$@"',  # the parent died before the signal was set: stop
        str(os.getpid() if parent is None else parent),
        *anchor,
        "timeout",
        "--signal=KILL",
        f"{max(deadline_s, 1.0):.0f}s",
        "setpriv",
        "--pdeathsig",
        "KILL",
        *trim,
        "--",
        *argv,
    ]


def remove_tree(path: Path) -> None:
    """Remove a run folder as far as it goes; missing is fine. Whatever cannot be removed (say a
    mount inside it: EBUSY) stays for the confirm-absent check to report, never an exception
    out of a destroy (``reap`` crashed on it instead of alerting and exiting 3)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
