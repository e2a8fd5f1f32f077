"""``cleanroom shell`` driven through a real pseudo-terminal (``os.forkpty``), as a person at a
terminal would: the guest's shell sees this terminal's window size and its change (SIGWINCH),
Ctrl-C interrupts the guest's command and not the CLI, ``exit 5`` is the CLI's exit status, and
afterwards the session is durable (``completed``) and its env confirmed absent in the ledger.
The fake driver runs the real agent and session; ``test_shell_on_qemu`` the same on a real VM.
On the old code there was no ``shell`` command."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline

pytestmark = pytest.mark.timeout(300)


class Terminal:
    """The CLI on the child side of a pty; this side types and reads."""

    def __init__(self, home: Path, *args: str) -> None:
        pid, fd = os.forkpty()
        if pid == 0:  # the child: the CLI, on the pty's terminal
            env = {**os.environ, "CLEANROOM_HOME": str(home), "TERM": "dumb", "PS1": "$ "}
            os.execve(sys.executable, [sys.executable, "-m", "cleanroom", "shell", *args], env)
        self.pid, self.fd = pid, fd
        self.seen = bytearray()
        self.resize(33, 111)

    def resize(self, rows: int, cols: int) -> None:
        """Like a terminal window resized: the kernel sends SIGWINCH to the CLI."""
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def expect(self, text: bytes, timeout_s: float = 120) -> None:
        start = len(self.seen)
        deadline = time.monotonic() + timeout_s
        while text not in self.seen[start - 200 if start > 200 else 0 :]:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {text!r} in {bytes(self.seen[-2000:])!r}"
            if select.select([self.fd], [], [], remaining)[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    chunk = b""
                assert chunk, f"the CLI ended before {text!r}: {bytes(self.seen[-2000:])!r}"
                self.seen.extend(chunk)

    def exit_status(self, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with_output = select.select([self.fd], [], [], 0.1)[0]
            if with_output:
                with contextlib.suppress(OSError):
                    self.seen.extend(os.read(self.fd, 65536))
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the CLI did not exit: {bytes(self.seen[-2000:])!r}")


def drive(term: Terminal, uid: bytes = b"0") -> None:
    term.expect(b"exit to leave", timeout_s=240)
    term.type(b"echo uid-$(id -u)\r")
    term.expect(b"uid-" + uid)
    term.type(b"echo sum-$((6*7)); stty size\r")
    term.expect(b"sum-42")
    term.expect(b"33 111")
    term.resize(40, 120)
    time.sleep(0.5)  # the SIGWINCH's RESIZE frame goes ahead of the next keys anyway
    term.type(b"stty size\r")
    term.expect(b"40 120")
    term.type(b"sleep 1000\r")
    time.sleep(1.0)
    term.type(b"\x03")  # Ctrl-C: the guest's sleep ends, the CLI and the shell go on
    term.type(b"echo after-$((1+1))\r")
    term.expect(b"after-2")
    term.type(b"exit 5\r")
    assert term.exit_status() == 5, bytes(term.seen[-2000:])
    assert b"confirmed absent" in term.seen


def assert_recorded(home: Path) -> None:
    with Ledger(home / "ledger.db") as ledger:
        runs = [r for r in ledger.list_runs() if r.run_id.startswith("session-")]
        assert len(runs) == 1, runs
        envs = ledger.envs(run_id=runs[0].run_id)
        assert envs and all(env.confirmed_absent_at is not None for env in envs), envs
        record = LocalStore(home / "store").get_record(runs[0].run_id, "shell")
    assert record is not None and record["outcome"] == "completed", record
    assert record["info"]["exit_code"] == 5


def test_shell_on_the_fake_driver(tmp_path: Path) -> None:
    baseline = make_fake_baseline(tmp_path)
    drive(Terminal(tmp_path, "--baseline", baseline.digest, "--driver", "fake"))
    assert_recorded(tmp_path)


@pytest.mark.vm
def test_shell_on_qemu(tmp_path: Path, tiny_baseline: object) -> None:
    """The same on a real VM, as the user ``agent`` (uid 1000)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.symlink(Path(os.environ["CLEANROOM_HOME"]) / "baselines", home / "baselines")
    os.symlink(Path(os.environ["CLEANROOM_HOME"]) / "cache", home / "cache")
    spec = str(Path(__file__).resolve().parents[1] / "baselines" / "tiny" / "baseline.toml")
    drive(Terminal(home, "--baseline", spec, "--user", "agent"), uid=b"1000")
    assert_recorded(home)


def test_a_shell_ends_at_its_own_timeout(tmp_path: Path) -> None:
    """A shell lives until ``--timeout`` (1 h by default; the baseline's ``timeout_s`` is meant
    for one entrypoint's run): past it the shell ends ``timeout``, its record durable and its
    env confirmed absent."""
    baseline = make_fake_baseline(tmp_path)
    term = Terminal(tmp_path, "--baseline", baseline.digest, "--driver", "fake", "--timeout", "3")
    term.expect(b"exit to leave", timeout_s=240)
    status = term.exit_status(timeout_s=60)
    assert status != 0, bytes(term.seen[-2000:])
    with Ledger(tmp_path / "ledger.db") as ledger:
        [run] = [r for r in ledger.list_runs() if r.run_id.startswith("session-")]
        envs = ledger.envs(run_id=run.run_id)
        assert envs and all(env.confirmed_absent_at is not None for env in envs), envs
        record = LocalStore(tmp_path / "store").get_record(run.run_id, "shell")
    assert record is not None and record["outcome"] == "timeout", record
