"""The host's end of the agent channel: one reader task dispatching frames to waiters by id.

Several requests run at once on one channel (an agent whose HELLO ``features`` has "mux").
Each request has a number (``open()``) and an ``Inbox``; the reader task puts every frame that
carries that ``id`` into it. Frames without an id (PONG, the OK of SNAPSHOT_PREPARE, and every
frame of an agent that does not multiplex) go to the one *unnumbered* inbox, which a request
holding the connection's lock opens. Every write is one ``writer.write`` (a frame is never
interleaved with another), so the host keeps the single-writer rule without a lock.

The guest is distrusted here too: a frame for a request the host never opened (or one already
finished), an id that is not an integer, more than an inbox may hold (``Inbox.hard``: a stream
past its window) or an unnumbered frame nobody waits for *breaks* the channel: every waiter,
and every later request, gets that ``ProtocolError`` and the caller destroys the env. Silence
longer than ``silence_timeout_s`` while someone waits is ``EnvCrashed`` (the guest sends a
HEARTBEAT every second while it has a request). An inbox over its soft limit (a slow consumer
of a command's output) stops the reader until it drains: the guest waits, the host's memory
stays bounded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from cleanroom.agent import protocol, wire
from cleanroom.agent.protocol import Frame, Kind
from cleanroom.errors import CleanroomError, EnvCrashed, FrameTooLarge, ProtocolError, Unsupported

TERMINAL = frozenset({Kind.DONE, Kind.FAILED, Kind.ERROR})  # a request's last frame
SOFT_LIMIT = 4 * 1024 * 1024  # bytes an inbox holds before the reader waits for its consumer
FRAME_COST = 64  # bytes counted per frame besides header and body (an empty frame costs too)


class Inbox:
    """Frames of one request, in order, until its consumer takes them.

    ``hard`` (bytes): more queued than this is the guest's protocol error (a stream past its
    window); else, past ``SOFT_LIMIT`` the reader waits until the consumer catches up.
    """

    def __init__(self, hard: int | None = None) -> None:
        self.frames: collections.deque[tuple[Frame, int]] = collections.deque()
        self.cost = 0
        self.hard = hard
        self.ready = asyncio.Event()  # frames waiting (or the channel broke)
        self.drained = asyncio.Event()  # below SOFT_LIMIT again
        self.drained.set()

    def put(self, frame: Frame, cost: int) -> None:
        self.frames.append((frame, cost))
        self.cost += cost
        self.ready.set()
        if self.hard is not None:  # a stream: the guest keeps to its window, the reader never waits
            if self.cost > self.hard:
                raise ProtocolError(f"the guest sent {self.cost} bytes past a stream's window")
        elif self.cost > SOFT_LIMIT:
            self.drained.clear()

    def pop(self) -> Frame | None:
        if not self.frames:
            return None
        frame, cost = self.frames.popleft()
        self.cost -= cost
        if not self.frames:
            self.ready.clear()
        if self.cost <= SOFT_LIMIT:
            self.drained.set()
        return frame


class Channel:
    """Frames in and out of one connected agent (see the module docstring)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_body: int,
        silence_timeout_s: float,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.max_body = max_body
        self.silence_timeout_s = silence_timeout_s
        self._waiters: dict[int, Inbox] = {}
        self._retired: set[int] = set()  # closed by the host early: late frames are dropped
        self._last_id = 0
        self._unnumbered: Inbox | None = None
        self._broken: CleanroomError | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_heard = time.monotonic()
        self.features: frozenset[str] = frozenset()
        self.agent_version = "?"

    def adopt_hello(self, hello: dict[str, Any]) -> None:
        """What the agent said it serves (HELLO ``features``, ``agent_version``)."""
        listed = hello.get("features")
        if isinstance(listed, list):
            self.features = frozenset(f for f in listed if isinstance(f, str) and len(f) < 32)
        self.agent_version = wire.guest_text(hello.get("agent_version"), 40)

    def require(self, feature: str, what: str) -> None:
        """Raise ``Unsupported`` unless the agent's HELLO lists ``feature``."""
        if feature not in self.features:
            raise Unsupported(
                f"{what}: this env's guest agent ({self.agent_version}) does not serve it"
            )

    # -- reading --------------------------------------------------------------------------------

    async def read_frame(self) -> tuple[Frame, int]:
        """One frame straight off the channel and what it costs (only before ``start``)."""
        try:
            prefix = await self._reader.readexactly(protocol.PREFIX.size)
            kind, hlen, blen = protocol.parse_prefix(prefix, self.max_body)
            header = wire.decode_header(await self._reader.readexactly(hlen))
            body = await self._reader.readexactly(blen) if blen else b""
        except asyncio.IncompleteReadError as exc:
            raise EnvCrashed("agent channel closed") from exc
        except (ConnectionError, OSError) as exc:
            raise EnvCrashed(f"agent channel failed: {exc}") from exc
        except protocol.TooLarge as exc:
            raise FrameTooLarge(str(exc)) from exc
        except protocol.BadFrame as exc:
            raise ProtocolError(f"malformed frame from guest: {exc}") from exc
        self.last_heard = time.monotonic()
        return Frame(kind, header, body), hlen + blen + FRAME_COST

    def start(self) -> None:
        """Begin dispatching (idempotent); from now on only the reader task reads."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            while True:
                frame, cost = await self.read_frame()
                if frame.kind == Kind.HEARTBEAT:
                    continue
                inbox = self._inbox_for(frame)
                if inbox is not None:
                    inbox.put(frame, cost)
                    if not inbox.drained.is_set():
                        await inbox.drained.wait()
        except CleanroomError as exc:
            self.break_with(exc)

    def _inbox_for(self, frame: Frame) -> Inbox | None:
        rid = frame.header.get("id")
        name = protocol.kind_name(frame.kind)
        if rid is None:
            if self._unnumbered is None:
                raise ProtocolError(f"unexpected {name} from the guest outside of a request")
            return self._unnumbered
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise ProtocolError(f"{name} with a request id that is not an integer")
        inbox = self._waiters.get(rid)
        if inbox is not None:
            if frame.kind in TERMINAL:  # nothing may follow it
                del self._waiters[rid]
            return inbox
        if rid in self._retired:
            if frame.kind in TERMINAL:
                self._retired.discard(rid)
            return None
        raise ProtocolError(f"{name} for request {rid}, which is not open")

    def break_with(self, exc: CleanroomError) -> None:
        """The channel is unusable: every waiter (and every later request) gets ``exc``."""
        if self._broken is None:
            self._broken = exc
        for inbox in [*self._waiters.values(), self._unnumbered]:
            if inbox is not None:
                inbox.ready.set()
                inbox.drained.set()

    def check(self) -> None:
        if self._broken is not None:
            raise self._broken

    async def take(self, inbox: Inbox) -> Frame:
        """The inbox's next frame; an ERROR frame is the guest's ProtocolError."""
        started = time.monotonic()
        while True:
            frame = inbox.pop()
            if frame is not None:
                if frame.kind == Kind.ERROR:
                    message = wire.guest_text(frame.header.get("message"))
                    raise ProtocolError(f"guest agent error: {message}")
                return frame
            self.check()
            since = max(self.last_heard, started)
            remaining = since + self.silence_timeout_s - time.monotonic()
            if remaining <= 0:
                silent = f"{self.silence_timeout_s:.0f}s"
                self.break_with(EnvCrashed(f"guest agent silent for {silent} (no heartbeat)"))
                self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(inbox.ready.wait(), remaining)

    # -- requests -------------------------------------------------------------------------------

    def open(self, hard: int | None = None) -> tuple[int, Inbox]:
        """A new request number and its inbox (the caller sends the request)."""
        self.check()
        self.start()
        self._last_id += 1
        inbox = Inbox(hard)
        self._waiters[self._last_id] = inbox
        return self._last_id, inbox

    def close(self, rid: int, *, finished: bool) -> None:
        """The host is done with request ``rid``; unless its last frame came (``finished``),
        frames still on their way are dropped until it does."""
        if self._waiters.pop(rid, None) is not None and not finished:
            self._retired.add(rid)

    @contextlib.asynccontextmanager
    async def unnumbered(self) -> AsyncIterator[Inbox]:
        """The inbox of frames without an id, for one request at a time (the caller's lock)."""
        self.check()
        self.start()
        self._unnumbered = inbox = Inbox()
        try:
            yield inbox
        finally:
            self._unnumbered = None

    # -- writing --------------------------------------------------------------------------------

    async def send(
        self, kind: int, header: dict[str, object] | None = None, body: bytes = b""
    ) -> None:
        self.check()
        try:
            frame = protocol.encode(kind, header, body)
        except protocol.TooLarge as exc:  # nothing was sent: the channel is intact
            raise FrameTooLarge(str(exc)) from exc
        try:
            self._writer.write(frame)
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            raise EnvCrashed(f"agent channel failed: {exc}") from exc

    def send_nowait(self, kind: int, header: dict[str, object] | None = None) -> None:
        """A frame from a ``finally`` that must not wait (KILL of a request left early)."""
        if self._broken is None:
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                self._writer.write(protocol.encode(kind, header))

    async def aclose(self) -> None:
        self.break_with(EnvCrashed("the agent connection was closed"))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._writer.close()
        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
