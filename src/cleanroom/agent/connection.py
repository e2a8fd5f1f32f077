"""The host's side of the agent channel: typed requests over frames, with the guest distrusted.

Whatever the guest sends is checked before it touches the host: frame sizes (``max_body``),
headers and names through the one boundary ``wire`` (bounded JSON, validated names), the
episode's output quota (stdout + stderr + artifacts + result together), no links followed, and
the artifact count and how many are open at once (``MAX_OPEN_ARTIFACTS``: each holds a host
file descriptor). Anything malformed raises a ``ProtocolError`` subclass; the caller then
destroys the environment. Transfers of any size are chunked (``protocol.CHUNK`` per frame).
Commands and streams of a multiplexing agent live in ``commands`` and ``transfers``; the frames
go through ``channel``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Unpack

from cleanroom.agent import commands, fs, ports, protocol, transfers, wire
from cleanroom.agent.bulk import BulkDisk
from cleanroom.agent.channel import Channel, Inbox
from cleanroom.agent.commands import CommandOptions, GuestProcess, SpawnOptions
from cleanroom.agent.protocol import MAX_ARTIFACTS, RESULT_MAX_BYTES, Frame, Kind
from cleanroom.agent.results import ExecResult, Output, OutputCallback, Quota, exit_result
from cleanroom.errors import (
    EnvCrashed,
    ProtocolError,
    QuotaExceeded,
    UnsafePath,
)

__all__ = [
    "AgentConnection",
    "Artifact",
    "EpisodeOutput",
    "ExecResult",
    "GuestProcess",
    "Output",
    "OutputCallback",
    "safe_relpath",
]

MAX_OPEN_ARTIFACTS = 8  # begun and not finished at once (the agent sends them one at a time)
safe_relpath = wire.guest_name  # the name other modules know the artifact-name check by


@dataclass(frozen=True)
class Artifact:
    name: str
    size: int
    sha256: str
    path: Path


@dataclass
class EpisodeOutput:
    """Everything an episode sent back, staged on the host (not yet durable)."""

    exit: ExecResult
    artifacts: list[Artifact] = field(default_factory=list)
    result_raw: bytes | None = None
    stdout_path: Path | None = None
    stderr_path: Path | None = None
    entry: dict[str, str] = field(default_factory=dict)  # EXIT's "entry"/"worker" (guest's word)


class AgentConnection:
    """A connected agent. Created by a driver.

    An agent whose HELLO lists "mux" in ``features`` serves several requests at once (``exec``,
    ``spawn``, the streams of ``transfers``), each numbered, through the channel's reader task;
    the rest (``ping``, ``snapshot_prepare``, ``run_episode``) run one at a time under a lock.
    Commands and file transfers need "mux" (the first protocol's unnumbered EXEC, PUT and GET
    are retired on both sides; the native agent, the only one built, multiplexes): an agent
    without it gets ``Unsupported`` before anything is sent.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_body: int = protocol.DEFAULT_MAX_BODY,
        silence_timeout_s: float = 15.0,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.channel = Channel(
            reader, writer, max_body=max_body, silence_timeout_s=silence_timeout_s
        )
        self._lock = asyncio.Lock()
        self._current: Inbox | None = None  # the unnumbered inbox of the lock holder (mux)
        self.hello: dict[str, Any] = {}
        self.bulk: BulkDisk | None = None  # the VM's bulk disk (the qemu driver's), if any

    @property
    def silence_timeout_s(self) -> float:
        return self.channel.silence_timeout_s

    @silence_timeout_s.setter
    def silence_timeout_s(self, value: float) -> None:
        self.channel.silence_timeout_s = value

    @property
    def features(self) -> frozenset[str]:
        """What the agent serves beyond the first protocol (its HELLO's ``features``)."""
        return self.channel.features

    @property
    def mux(self) -> bool:
        """Does the agent multiplex requests (and so serve the newer requests at all)?"""
        return "mux" in self.channel.features

    def require(self, feature: str, what: str) -> None:
        self.channel.require(feature, what)

    # -- framing --------------------------------------------------------------------------------

    async def _read(self) -> Frame:
        """The next frame of the one request in progress (not a heartbeat); silence past the
        timeout is a crash, an ERROR frame the guest's ProtocolError."""
        if self._current is not None:
            return await self.channel.take(self._current)
        while True:
            try:
                frame, _ = await asyncio.wait_for(self.channel.read_frame(), self.silence_timeout_s)
            except TimeoutError:
                raise EnvCrashed(
                    f"guest agent silent for {self.silence_timeout_s:.0f}s (no heartbeat)"
                ) from None
            if frame.kind == Kind.ERROR:
                raise ProtocolError(
                    f"guest agent error: {wire.guest_text(frame.header.get('message'))}"
                )
            if frame.kind != Kind.HEARTBEAT:
                return frame

    async def _send(
        self, kind: int, header: dict[str, Any] | None = None, body: bytes = b""
    ) -> None:
        await self.channel.send(kind, header, body)

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self) -> AsyncIterator[None]:
        """A request without an id: the lock, and (with "mux") the unnumbered inbox."""
        async with self._lock:
            if not self.mux:
                yield
                return
            async with self.channel.unnumbered() as inbox:
                self._current = inbox
                try:
                    yield
                finally:
                    self._current = None

    async def wait_hello(self) -> dict[str, Any]:
        """Wait for the agent's HELLO (no silence timeout: the caller bounds the boot)."""
        frame, _ = await self.channel.read_frame()
        if frame.kind == Kind.ERROR:
            raise ProtocolError(
                f"guest agent error: {wire.guest_text(frame.header.get('message'))}"
            )
        if frame.kind != Kind.HELLO:
            raise ProtocolError(f"expected HELLO, got {protocol.kind_name(frame.kind)}")
        self.hello = frame.header
        self.channel.adopt_hello(frame.header)
        return self.hello

    # -- requests -------------------------------------------------------------------------------

    async def ping(self) -> float:
        """Round trip time in seconds."""
        async with self._one_at_a_time():
            start = time.perf_counter()
            await self._send(Kind.PING, {"t": start})
            frame = await self._read()
            if frame.kind != Kind.PONG:
                raise ProtocolError(f"expected PONG, got {protocol.kind_name(frame.kind)}")
            return time.perf_counter() - start

    async def snapshot_prepare(self) -> dict[str, Any]:
        """Tell the agent a snapshot of this env follows (SNAPSHOT_PREPARE) and wait for its OK;
        the OK's header (which reseeder will answer the clones' RESEED, and why).

        Afterwards the agent takes a closed channel for "wait for the next host" (a clone's).
        """
        async with self._one_at_a_time():
            await self._send(Kind.SNAPSHOT_PREPARE)
            frame = await self._read()
            if frame.kind != Kind.OK or frame.header.get("prepared") is not True:
                name = protocol.kind_name(frame.kind)
                raise ProtocolError(f"the agent answered SNAPSHOT_PREPARE with {name}")
            return frame.header

    async def warm_up(self) -> dict[str, Any]:
        """Have the warm worker walk an episode's Python paths once (WARM_UP, a spare's); its OK
        (``warmed``: whether the worker answered). Only for a HELLO whose ``warm`` says
        ``warm_up``."""
        async with self._one_at_a_time():
            await self._send(Kind.WARM_UP)
            frame = await self._read()
            if frame.kind != Kind.OK or not isinstance(frame.header.get("warmed"), bool):
                raise ProtocolError(
                    f"the agent answered WARM_UP with {protocol.kind_name(frame.kind)}"
                )
            return frame.header

    async def rejoin(self, header: dict[str, Any], entropy: bytes) -> dict[str, Any]:
        """After a snapshot of this env, which lives on (``fork_live``): RESEED it as a clone
        is (``header``: its own id, the clock; fresh ``entropy``) and return the HELLO it
        answers with (``hello`` keeps the first one)."""
        async with self._one_at_a_time():
            await self._send(Kind.RESEED, header, entropy)
            frame = await self._read()
            if frame.kind != Kind.HELLO:
                name = protocol.kind_name(frame.kind)
                raise ProtocolError(f"the agent answered RESEED with {name}")
            return frame.header

    async def exec(
        self, argv: list[str], *, stdin: bytes | None = None, **options: Unpack[CommandOptions]
    ) -> ExecResult:
        """Run ``argv`` to its end; output reaches the callbacks as it comes (``commands``)."""
        self.require("mux", "a command")
        return await commands.run(self.channel, argv, stdin=stdin, **options)

    async def put(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` in the guest: through the bulk disk where the VM has one,
        else streamed in chunks (``transfers``)."""
        bulk = self.bulk
        if (
            bulk is not None
            and bulk.usable(self.channel)
            and await bulk.put(self.channel, path, data, mode)
        ):
            return
        self.require("mux", f"writing {path}")
        await transfers.put_stream(self.channel, path, transfers.chunks_of(data), mode)

    async def get(self, path: str, *, max_size: int = 64 * 1024 * 1024) -> bytes:
        """The whole file (``QuotaExceeded`` past ``max_size``), through the bulk disk where
        the VM has one, else streamed (``transfers``)."""
        if self.bulk is not None and self.bulk.usable(self.channel):
            whole = await self.bulk.get(self.channel, path, max_size)
            if whole is not None:
                return whole
        self.require("mux", f"reading {path}")
        return await transfers.get_all(self.channel, path, max_size)

    async def spawn(self, argv: list[str], **options: Unpack[SpawnOptions]) -> GuestProcess:
        """Start ``argv`` and return once it runs (``commands.spawn``: stdin, kill, resize,
        wait); ``Unsupported`` on an agent that does not multiplex."""
        return await commands.spawn(self.channel, argv, **options)

    async def fs(
        self, op: str, path: str, *, dest: str | None = None, depth: int = 1
    ) -> fs.Listing:
        """A filesystem operation in the guest (``fs.OPS``): stat and list answer entries."""
        return await fs.request(self.channel, op, path, dest=dest, depth=depth)

    async def connect_port(self, port: int) -> ports.PortStream:
        """A TCP connection to ``127.0.0.1:port`` in the guest over this channel (``ports``);
        ``PortUnreachable`` where nothing listens; the caller closes it (``aclose``)."""
        return await ports.connect(self.channel, port)

    async def put_stream(self, path: str, chunks: AsyncIterable[bytes], mode: int = 0o644) -> int:
        """Write a stream of any size to ``path``; returns its size."""
        return await transfers.put_stream(self.channel, path, chunks, mode)

    def get_stream(self, path: str) -> AsyncIterator[bytes]:
        """The file at ``path`` as it arrives (``GuestFileNotFound`` if it is not there)."""
        return transfers.get_stream(self.channel, path)

    async def put_tar(self, dest_dir: str, chunks: AsyncIterable[bytes]) -> int:
        """Unpack a tar stream into ``dest_dir`` in the guest (safely: ``native/tar.c``)."""
        return await transfers.put_stream(self.channel, dest_dir, chunks, 0o755, tar=True)

    def get_tar(self, src_dir: str) -> AsyncIterator[bytes]:
        """The folder ``src_dir`` of the guest as a tar stream."""
        return transfers.get_stream(self.channel, src_dir, tar=True)

    async def request(
        self, kind: int, header: dict[str, Any] | None = None, body: bytes = b""
    ) -> Frame:
        """One request answered by one frame (an extension's kinds: ``gym_worker``'s 40-46)."""
        async with self._one_at_a_time():
            await self._send(kind, header, body)
            return await self._read()

    async def shutdown(self) -> None:
        """Ask the guest to power off (best effort; destroy does not depend on it)."""
        with contextlib.suppress(EnvCrashed, ProtocolError):
            await self._send(Kind.SHUTDOWN)

    async def run_episode(
        self,
        request: dict[str, Any],
        staging: Path,
        *,
        quota_bytes: int,
        charged: Callable[[], int] | None = None,
    ) -> EpisodeOutput:
        """Send RUN and stage everything the episode returns under ``staging`` (``charged``:
        bytes the quota also counts, such as its console)."""
        async with self._one_at_a_time():
            quota = Quota(quota_bytes, charged)
            return await _EpisodeCollector(self, staging, quota).run(request)

    async def aclose(self) -> None:
        await self.channel.aclose()


def _entry_facts(header: dict[str, Any]) -> dict[str, str]:
    """How the guest ran the entrypoint (``entry``: function; ``worker``: warm or started)."""
    return {
        key: value[:32]
        for key in ("entry", "worker")
        if isinstance(value := header.get(key), str) and value.isidentifier()
    }


class _EpisodeCollector:
    """Receives one RUN's frames into a staging folder, enforcing the quota and names."""

    def __init__(self, session: AgentConnection, staging: Path, quota: Quota) -> None:
        self.session = session
        self.staging = staging
        self.quota = quota
        self.artifacts_dir = staging / "artifacts"
        self.logs_dir = staging / "logs"
        self.files: dict[str, tuple[int, Any]] = {}  # name -> (fd, sha256 object)
        self.sizes: dict[str, int] = {}
        self.digests: dict[str, str] = {}
        self.result: bytearray | None = None  # result.json so far (None: absent)
        self.result_done = False

    async def run(self, request: dict[str, Any]) -> EpisodeOutput:
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        stdout_path, stderr_path = self.logs_dir / "stdout.log", self.logs_dir / "stderr.log"
        exited: ExecResult | None = None
        output = EpisodeOutput(exit=exit_result({}, b"", b""))
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
            await self.session._send(Kind.RUN, request)
            try:
                while True:
                    frame = await self.session._read()
                    if frame.kind in (Kind.STDOUT, Kind.STDERR):
                        self.quota.take(len(frame.body))
                        (out if frame.kind == Kind.STDOUT else err).write(frame.body)
                    elif frame.kind == Kind.EXIT:
                        exited = exit_result(frame.header, b"", b"")
                        output.entry = _entry_facts(frame.header)
                    elif frame.kind == Kind.FILE:
                        self._file_chunk(frame)
                    elif frame.kind == Kind.RESULT:
                        self._result_chunk(frame)
                    elif frame.kind == Kind.DONE:
                        break
                    else:
                        raise ProtocolError(
                            f"unexpected {protocol.kind_name(frame.kind)} during an episode"
                        )
            finally:
                for fd, _ in self.files.values():
                    os.close(fd)
        if exited is None:
            raise ProtocolError("episode ended without an EXIT frame")
        output.exit = exited
        output.result_raw = bytes(self.result) if self.result is not None else None
        output.stdout_path, output.stderr_path = stdout_path, stderr_path
        output.artifacts = [
            Artifact(name, self.sizes[name], digest, self.artifacts_dir / name)
            for name, digest in sorted(self.digests.items())
        ]
        return output

    def _result_chunk(self, frame: Frame) -> None:
        """One chunk of result.json (a header without ``eof``: the whole file, older agents).

        The guest sends at most ``RESULT_MAX_BYTES + 1`` bytes (enough to say "too large",
        which ``record.parse_guest_result`` reports); more, or chunks out of order, is its error.
        """
        header = frame.header
        if self.result_done:
            raise ProtocolError("a second result.json during one episode")
        self.quota.take(len(frame.body))
        if not header.get("present"):
            self.result_done = True
            return
        data = self.result if self.result is not None else bytearray()
        if header.get("offset", 0) != len(data):
            raise ProtocolError("result.json chunk out of order")
        if len(data) + len(frame.body) > RESULT_MAX_BYTES + 1:
            raise ProtocolError(f"the guest sent more than {RESULT_MAX_BYTES + 1} bytes of result")
        data.extend(frame.body)
        self.result = data
        self.result_done = header.get("eof", True) is True

    def _file_chunk(self, frame: Frame) -> None:
        header = frame.header
        name = header.get("name")
        if header.get("kind") != "artifact" or not isinstance(name, str):
            raise ProtocolError("FILE frame without an artifact name")
        rel = wire.guest_name(name)
        self.quota.take(len(frame.body))
        if name not in self.files:
            if header.get("offset") != 0 or name in self.sizes:
                raise ProtocolError(f"artifact {name!r} does not start at offset 0")
            if len(self.sizes) >= MAX_ARTIFACTS:
                raise QuotaExceeded(f"more than {MAX_ARTIFACTS} artifacts")
            if len(self.files) >= MAX_OPEN_ARTIFACTS:  # each holds a host file descriptor
                raise QuotaExceeded(f"more than {MAX_OPEN_ARTIFACTS} artifacts open at once")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                self._make_parents(rel)
                fd = os.open(self.artifacts_dir / rel, flags, 0o644)
            except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
                raise UnsafePath(f"artifact name {name!r} collides with another") from exc
            self.files[name] = (fd, hashlib.sha256())
            self.sizes[name] = 0
        fd, digest = self.files[name]
        if header.get("offset") != self.sizes[name]:
            raise ProtocolError(f"artifact {name!r}: chunk out of order")
        os.write(fd, frame.body)
        digest.update(frame.body)
        self.sizes[name] += len(frame.body)
        if header.get("eof"):
            os.close(fd)
            del self.files[name]
            self.digests[name] = digest.hexdigest()

    def _make_parents(self, rel: PurePosixPath) -> None:
        """Create parent folders one by one, refusing any that is (or became) a symlink."""
        current = self.artifacts_dir
        for part in rel.parts[:-1]:
            current = current / part
            if current.is_symlink():
                raise UnsafePath(f"artifact folder {part!r} is a link")
            current.mkdir(exist_ok=True)
