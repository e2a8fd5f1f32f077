"""``cleanroom shell``: a terminal in a fresh env, recorded as a session, destroyed on exit.

The guest runs an interactive shell on a PTY (``env.spawn(..., pty=(rows, cols))``) as root or
``user``; this terminal is put in raw mode, so every key (Ctrl-C, Ctrl-Z, Ctrl-D) reaches the
guest's line discipline, which signals the guest's foreground process as a local terminal
would. The window size follows SIGWINCH. Leaving the shell (``exit``, end of input, the guest's
process ending, or SIGTERM/SIGHUP to this process) finishes the session: its record and
transcript are exported, then the env is destroyed and confirmed absent, as for any session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from cleanroom.agent.connection import ExecResult
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Driver
from cleanroom.ledger import Ledger
from cleanroom.sessions import session
from cleanroom.store import Store

SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null; then exec bash -i; fi; exec sh -i"]


def window(fd: int) -> tuple[int, int]:
    """The terminal's (rows, cols), or 24x80 where ``fd`` is not one."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        size = shutil.get_terminal_size((80, 24))
    return size.lines, size.columns


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """``fd``'s terminal in raw mode (keys pass through unprocessed), restored afterwards."""
    if not os.isatty(fd):
        yield
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)  # keep what was typed ahead (TCSAFLUSH drops it)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def attach(
    env: Any, argv: list[str], *, user: str | None, stdin: int, stdout: int
) -> ExecResult:
    """Run ``argv`` on a PTY in ``env``, wired to this terminal, until it ends."""
    loop = asyncio.get_running_loop()
    keys: asyncio.Queue[bytes] = asyncio.Queue()

    def on_key() -> None:
        try:
            data = os.read(stdin, 65536)
        except OSError:
            data = b""
        keys.put_nowait(data)
        if not data:
            loop.remove_reader(stdin)

    process = await env.spawn(
        argv,
        pty=window(stdin),
        user=user,
        env={"TERM": os.environ.get("TERM", "xterm")},
        on_stdout=lambda chunk: _write_all(stdout, chunk),
    )

    async def forward() -> None:
        while data := await keys.get():
            await process.write_stdin(data)
        await process.close_stdin()

    resizes: set[asyncio.Future[None]] = set()

    def resized() -> None:
        task = asyncio.ensure_future(process.resize(*window(stdin)))
        resizes.add(task)
        task.add_done_callback(resizes.discard)

    undo: list[Callable[[], object]] = []
    with raw_mode(stdin):
        loop.add_reader(stdin, on_key)
        undo.append(lambda: loop.remove_reader(stdin))
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread
            loop.add_signal_handler(signal.SIGWINCH, resized)
            undo.append(lambda: loop.remove_signal_handler(signal.SIGWINCH))
        feeder = asyncio.ensure_future(forward())
        try:
            return await process.wait()  # type: ignore[no-any-return]
        finally:
            feeder.cancel()
            for step in undo:
                step()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue


async def shell(
    baseline: Baseline,
    *,
    driver: Driver,
    ledger: Ledger,
    store: Store,
    user: str | None = None,
    timeout_s: float = 3600.0,
    stdin: int = 0,
    stdout: int = 1,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> tuple[int, str]:
    """A shell session (see the module docstring); its exit code and the session's run id.
    ``timeout_s``: how long the shell may live (the baseline's episode timeout is meant for
    one episode's run, far shorter than a person at a terminal)."""
    progress(f"starting a fresh {driver.name} env of {baseline.digest[:19]}…")
    async with session(
        baseline,
        driver=driver,
        ledger=ledger,
        store=store,
        episode_id="shell",
        timeout_s=timeout_s,
    ) as sb:
        run_id = sb.episode.key.run_id
        progress(f"session {run_id}: {'user ' + user if user else 'root'}; exit to leave\r")
        result = await attach(sb.episode.env, SHELL, user=user, stdin=stdin, stdout=stdout)
        info = {"exit_code": result.exit_code, "signal": result.signal, "user": user}
        sb.finish(reward=0.0, info=info)
    code = result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)
    return code, run_id
