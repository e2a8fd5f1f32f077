"""What a guest command did (``ExecResult``) and its output as it arrives (``Output``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cleanroom.agent.protocol import Kind
from cleanroom.errors import CommandFailed, CommandTimeout, QuotaExceeded


@dataclass(frozen=True)
class ExecResult:
    """What a process in the guest did. The exit code is data; ``check()`` makes it an error."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> ExecResult:
        """This result, if the command succeeded; else ``CommandTimeout`` (it ran past its
        ``timeout_s``) or ``CommandFailed`` (non-zero exit, signal), carrying this result."""
        if self.timed_out:
            raise CommandTimeout(
                f"guest command timed out after {self.duration_s:.1f}s (its process group was "
                f"killed): {self.stderr[-500:].decode(errors='replace')}",
                self,
            )
        if not self.ok:
            raise CommandFailed(
                f"guest command failed (exit {self.exit_code}, signal {self.signal}): "
                f"{self.stderr[-500:].decode(errors='replace')}",
                self,
            )
        return self


class Quota:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise QuotaExceeded(f"episode output exceeds its quota of {self.limit} bytes")


OutputCallback = Callable[[bytes], Any]  # called with each chunk; may return an awaitable


class Output:
    """A command's stdout and stderr as they arrive: kept (within ``max_output`` together,
    else ``QuotaExceeded``) and handed to the callbacks chunk by chunk."""

    def __init__(
        self,
        max_output: int,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> None:
        self.quota = Quota(max_output)
        self.out, self.err = bytearray(), bytearray()
        self.callbacks = {Kind.STDOUT: on_stdout, Kind.STDERR: on_stderr}

    async def add(self, kind: int, data: bytes) -> None:
        self.quota.take(len(data))
        (self.out if kind == Kind.STDOUT else self.err).extend(data)
        callback = self.callbacks.get(kind)
        if callback is not None and data:
            answer = callback(data)
            if inspect.isawaitable(answer):
                await answer

    def result(self, header: dict[str, Any]) -> ExecResult:
        return exit_result(header, bytes(self.out), bytes(self.err))


def exit_result(header: dict[str, Any], out: bytes, err: bytes) -> ExecResult:
    def _int(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    duration = header.get("duration_s")
    return ExecResult(
        exit_code=_int(header.get("code")),
        signal=_int(header.get("signal")),
        stdout=out,
        stderr=err,
        duration_s=float(duration) if isinstance(duration, int | float) else 0.0,
        timed_out=header.get("timed_out") is True,
    )
