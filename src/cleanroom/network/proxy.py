"""One env's egress proxy: the only way out of a networked VM.

The proxy listens on an abstract unix socket named after the env. For each guest connection to
a forward of its plan (see ``plan.py``), QEMU runs ``fdpass.py``, which hands the connection over
with the forward's tag; only processes of the controller's own uid are heard. Per tag:

- ``proxy``: an HTTP proxy. ``CONNECT host:port`` is checked against the allowlist, resolved and
  connected on the host, then relayed; an absolute-form ``http://`` request likewise (sent on
  with ``Connection: close``). Anything else: 400; a destination not on the list: 403.
- ``dns``: DNS over TCP. An allowed exact name is answered with its synthetic guest address; a
  name allowed only through the HTTP proxy gets an empty answer; any other name NXDOMAIN.
- ``tcp-N``: relayed to the forward's name and port (checked against the allowlist again).

Every connection and DNS query becomes a ``NetEvent`` (destination, allowed or denied and why,
bytes each way, times), passed to ``on_event`` and kept, up to ``max_events``. ``hosts`` maps
names to addresses before the host's resolver is asked (tests; pinning a name).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import struct
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from cleanroom.network import flows
from cleanroom.network.events import Flow, NetEvent
from cleanroom.network.plan import Plan, plan_for
from cleanroom.network.policy import Policy
from cleanroom.network.qemu_args import Attachment

HANDOFF_TIMEOUT_S = 5.0
HEAD_LIMIT = 16 * 1024


class EgressProxy:
    """The egress proxy of one env; ``start()`` it, give the driver its ``Attachment``,
    ``aclose()`` it when the env is gone (idempotent; open connections are cut)."""

    def __init__(
        self,
        policy: Policy,
        *,
        name: str,
        on_event: Callable[[NetEvent], None] | None = None,
        hosts: Mapping[str, str] | None = None,
        max_flows: int = 64,
        max_events: int = 10_000,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.policy = policy
        self.plan: Plan = plan_for(policy)
        self.name = f"{name}-{secrets.token_hex(4)}"
        self.hosts = dict(hosts or {})
        self.connect_timeout_s = connect_timeout_s
        self.events: list[NetEvent] = []
        self.dropped = 0
        self._on_event = on_event
        self._max_flows, self._max_events = max_flows, max_events
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._active = 0  # connections being served

    async def start(self) -> Attachment:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + self.name)
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._spawn(self._accept_loop(sock))
        return Attachment(self.name, self.plan.forwards)

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._tasks):  # the accept loop first stops watching the socket
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()

    def record(self, flow: Flow) -> None:
        if len(self.events) >= self._max_events:
            self.dropped += 1
            return
        event = flow.event()
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    async def connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, Any, str]:
        """Resolve and connect on the host (``hosts`` first); returns reader, writer, peer."""
        target = self.hosts.get(host, host)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(target, port), self.connect_timeout_s
        )
        address, used = writer.get_extra_info("peername")[:2]
        return reader, writer, f"[{address}]:{used}" if ":" in address else f"{address}:{used}"

    # -- the hand-off from QEMU's helper --------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError:
                if self._closed:
                    return
                await asyncio.sleep(0.05)
                continue
            self._spawn(self._handoff(conn))

    async def _handoff(self, conn: socket.socket) -> None:
        with conn:
            _, uid, _ = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            if uid != os.getuid():
                return
            try:
                await asyncio.wait_for(_readable(conn), HANDOFF_TIMEOUT_S)
                message, fds, _, _ = socket.recv_fds(conn, 256, 1)
            except (OSError, TimeoutError):
                return
            if not fds:
                return
            try:
                guest = socket.socket(fileno=fds[0])  # OSError if it is not a socket
            except OSError:
                os.close(fds[0])
                return
            with contextlib.suppress(OSError):
                conn.send(b"k")
        await self._serve(message.decode(errors="replace"), guest)

    async def _serve(self, tag: str, guest: socket.socket) -> None:
        forward = self.plan.forward(tag)
        if forward is None or guest.type != socket.SOCK_STREAM or self._active >= self._max_flows:
            flow = Flow("tcp", f"forward {tag}")
            flow.reason = "unknown forward" if forward is None else "too many connections"
            guest.close()
            self.record(flow)
            return
        self._active += 1
        reader, writer = await asyncio.open_connection(sock=guest, limit=HEAD_LIMIT)
        try:
            if tag == "proxy":
                await flows.serve_http(self, reader, writer)
            elif tag == "dns":
                await flows.serve_dns(self, reader, writer)
            elif forward.dest is not None:
                await flows.serve_tcp(self, forward.dest, reader, writer)
        except OSError:
            pass  # the guest or the destination went away; the flow has recorded itself
        finally:
            self._active -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _readable(conn: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())
