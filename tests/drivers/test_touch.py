"""``touch_guest_paths`` (drivers/qemu/touch.py), before a template's save and in a spare's run
ahead: what ran is reported, and a guest that fails any step only leaves its caches cold
(the template or the spare is still made). Real VMs: tests/drivers/qemu/test_spares.py."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any, cast

from cleanroom.agent.connection import AgentConnection
from cleanroom.agent.results import ExecResult
from cleanroom.drivers.qemu import touch
from cleanroom.errors import GuestFileNotFound, ProtocolError


class Guest:
    """The three calls touch makes, answered as told (an exception is raised)."""

    def __init__(
        self, exit_code: int | Exception, read: bytes | Exception, put: Exception | None = None
    ) -> None:
        self.exit_code, self.read, self.put_error = exit_code, read, put
        self.calls: list[Any] = []

    async def put(self, path: str, data: bytes) -> None:
        self.calls.append(("put", path, data))
        if self.put_error is not None:
            raise self.put_error

    async def exec(self, argv: list[str], **options: Any) -> ExecResult:
        self.calls.append(("exec", argv, options))
        if isinstance(self.exit_code, Exception):
            raise self.exit_code
        return ExecResult(self.exit_code, None, b"", b"", 0.01, False)

    async def get(self, path: str) -> bytes:
        self.calls.append(("get", path))
        if isinstance(self.read, Exception):
            raise self.read
        return self.read


def _touch(guest: Guest) -> dict[str, Any]:
    return asyncio.run(touch.touch_guest_paths(cast(AgentConnection, guest)))


def test_a_shell_a_put_and_a_read_are_reported_as_they_ran() -> None:
    """The shell script runs through /bin/sh with a timeout, 64 KiB go to /dev/null (nothing
    kept in the guest), and the read is of /etc/passwd."""
    guest = Guest(0, b"root:x:0:0::/root:/bin/sh\n")
    assert _touch(guest) == {"sh": 0, "put": 65536, "read": 26}
    [(_, argv, options), put, get] = guest.calls
    assert argv == ["/bin/sh", "-c", touch.SCRIPT] and options == {"timeout_s": touch.TIMEOUT_S}
    assert put == ("put", "/dev/null", bytes(65536))
    assert get == ("get", "/etc/passwd")


def test_a_baseline_without_a_shell_still_gets_the_put_and_the_read() -> None:
    assert _touch(Guest(127, b"x")) == {"sh": 127, "put": 65536, "read": 1}


def test_a_guest_that_fails_every_step_leaves_them_cold_and_raises_nothing() -> None:
    """Protects the build: a broken answer to any step is not the template's failure."""
    guest = Guest(
        ProtocolError("garbage"),
        GuestFileNotFound("in the guest: no such file"),
        put=ProtocolError("bulk put: DONE does not say 65536"),
    )
    assert _touch(guest) == {}
    assert len(guest.calls) == 3  # the put and the read were still tried after the shell failed


def test_the_script_leaves_no_file_behind() -> None:
    """The script, run by a real shell, writes its file and removes it (a name of its own
    process: no clash with a file of the baseline's)."""
    before = set(Path("/tmp").glob(".cleanroom-touch-*"))
    traced = subprocess.run(["/bin/sh", "-xc", touch.SCRIPT], capture_output=True, text=True)
    assert traced.returncode == 0, traced.stderr
    assert "echo" in traced.stderr and "rm -f /tmp/.cleanroom-touch-" in traced.stderr
    assert set(Path("/tmp").glob(".cleanroom-touch-*")) == before
