"""``sandbox.get_host(port)``: HTTP and WebSocket traffic to a TCP port in the guest, carried
over the agent channel (``agent/ports.py``, the native agent's CONNECT): no NIC, the guest
dials only its own 127.0.0.1, its egress rules are untouched.

Routing (``target_of``): a request is for a guest port when its Host is ``{port}-{sandbox
id}.{domain}`` (what the SDK's ``get_host`` returns) or it names the sandbox in the
``E2b-Sandbox-Id`` header with ``E2b-Sandbox-Port`` (the SDK's header form), and the port is
not envd's (49983: those go to envd's routes).

Auth: the sandbox's traffic access token in ``e2b-traffic-access-token`` (E2B's header; the
create / connect / info answers carry it as ``trafficAccessToken``, the SDK exposes it as
``sandbox.traffic_access_token``), or the owning key's ``X-API-Key``. A served port is never
public: without either, or with another key's, the answer is the unknown sandbox's 404. Both
headers are removed before the request reaches the guest.

HTTP: one guest connection per request; the request goes as HTTP/1.1 (``h11``) with
``Connection: close``, its body at most ``max_body`` (413); the answer is streamed back, at
most ``MAX_RESPONSE`` bytes (then cut). Nothing listening (or a guest server that closes
without answering, or stays silent ``IDLE_S``) is a 502 in E2B's JSON. WebSocket: the
handshake with the guest's server by ``wsproto``, then messages both ways (each at most
``MAX_MESSAGE``; the connection at most ``MAX_RESPONSE`` bytes each way). Every byte to and
from the guest is counted (``PortCounts``, ``GET /metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import h11
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

from cleanroom.agent.ports import PortStream
from cleanroom.errors import CleanroomError, PortUnreachable
from cleanroom.server.control import Sandbox, Sandboxes
from cleanroom.server.keys import KeyRing

ENVD_PORT = 49983  # the SDK's ConnectionConfig.envd_port: envd's own routes, not a guest port
HOST_RE = re.compile(r"^(\d{1,5})-([A-Za-z0-9]+)\.")
IDLE_S = 60.0  # a guest server silent this long mid-answer: 502 (or the answer is cut)
MAX_RESPONSE = 256 * 1024 * 1024  # bytes one answer (or a WebSocket, each way) may carry
MAX_MESSAGE = 16 * 1024 * 1024  # bytes of one WebSocket message
DROPPED = frozenset(
    {
        b"e2b-traffic-access-token",
        b"x-api-key",
        b"x-access-token",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"upgrade",
        b"proxy-connection",
        b"content-length",
    }
)
HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int


def target_of(headers: dict[str, str]) -> Target | None:
    """The guest port a request is for (None: not a port request, e.g. envd's)."""
    sid, port = headers.get("e2b-sandbox-id"), headers.get("e2b-sandbox-port")
    if not (sid and port):
        m = HOST_RE.match(headers.get("host", ""))
        if m is None:
            return None
        port, sid = m.group(1), m.group(2)
    if not port.isdigit() or int(port) == ENVD_PORT:
        return None
    return Target(sid, int(port))


class PortCounts:
    """What the proxy moved: bytes each way, requests by kind and outcome."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()

    def lines(self) -> list[str]:
        return [
            "# TYPE cleanroom_serve_port_bytes_total counter",
            *(
                f'cleanroom_serve_port_bytes_total{{direction="{d}"}} {self.bytes[d]}'
                for d in ("to_guest", "from_guest")
            ),
            "# TYPE cleanroom_serve_port_requests_total counter",
            *(
                f'cleanroom_serve_port_requests_total{{kind="{k}",outcome="{o}"}} {n}'
                for (k, o), n in sorted(self.requests.items())
            ),
        ]


class _Counted:
    """A guest stream whose bytes are counted (and bounded) as they pass."""

    def __init__(self, stream: PortStream, counts: PortCounts) -> None:
        self.stream, self.counts = stream, counts
        self.read_total = 0

    async def write(self, data: bytes) -> None:
        if data:
            self.counts.bytes["to_guest"] += len(data)
            await self.stream.write(data)

    async def read(self, idle_s: float | None = IDLE_S) -> bytes:
        """The guest's next bytes (``b""``: it closed); ``TimeoutError`` after ``idle_s``."""
        data = await asyncio.wait_for(self.stream.read(), idle_s)
        self.read_total += len(data)
        self.counts.bytes["from_guest"] += len(data)
        return data


def _json(status: int, message: str) -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.dumps({"code": status, "message": message}).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
    }
    return start, {"type": "http.response.body", "body": body}


class PortProxy:
    """The ASGI half of ``cleanroom serve`` that answers port requests (module docstring)."""

    def __init__(
        self, sandboxes: Sandboxes, keys: KeyRing, max_body: int, counts: PortCounts
    ) -> None:
        self.sandboxes, self.keys, self.max_body, self.counts = sandboxes, keys, max_body, counts

    def allowed(self, target: Target, headers: dict[str, str]) -> Sandbox | None:
        sbx = self.sandboxes.by_id.get(target.sandbox_id)
        if sbx is None or not sbx.live:
            return None
        token = headers.get("e2b-traffic-access-token") or ""
        if token and hmac.compare_digest(token, sbx.traffic_token):
            return sbx
        key = headers.get("x-api-key")
        if key and self.keys.check(key) == sbx.key_id:
            return sbx
        return None

    @asynccontextmanager
    async def _open(self, sbx: Sandbox, port: int) -> AsyncIterator[_Counted]:
        """A counted connection to the guest port, inside a guest call of the session (its
        idle clock stopped; the session's end cancels it)."""
        assert sbx.sb is not None
        async with sbx.sb.guard.call() as env:
            agent = getattr(env, "session", None)
            if agent is None or "port" not in agent.features:
                raise PortUnreachable("this sandbox's guest agent does not serve ports")
            stream = await agent.connect_port(port)
            try:
                yield _Counted(stream, self.counts)
            finally:
                await stream.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        kind = scope["type"]
        sbx = self.allowed(target, headers)
        if sbx is None:
            self.counts.requests[(kind, "not_found")] += 1
            if kind == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            for message in _json(404, f"sandbox {target.sandbox_id!r} not found"):
                await send(message)
            return
        if kind == "websocket":
            await self._websocket(scope, receive, send, sbx, target.port)
        else:
            await self._http(scope, receive, send, sbx, target.port)

    # -- HTTP ---------------------------------------------------------------------------------

    async def _body(self, receive: Receive) -> bytes | None:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"\0" * (self.max_body + 1)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _http(
        self, scope: Scope, receive: Receive, send: Send, sbx: Sandbox, port: int
    ) -> None:
        body = await self._body(receive)
        if body is None:
            return
        if len(body) > self.max_body:
            self.counts.requests[("http", "too_large")] += 1
            for m in _json(413, f"the request body is over {self.max_body} bytes"):
                await send(m)
            return
        started = False
        outcome, why = "ok", ""
        try:
            async with self._open(sbx, port) as guest:
                conn = h11.Connection(h11.CLIENT)
                kept = [(k, v) for k, v in scope["headers"] if k.lower() not in DROPPED]
                target = scope.get("raw_path") or scope["path"].encode()
                if scope.get("query_string"):
                    target += b"?" + scope["query_string"]
                request = h11.Request(
                    method=scope["method"],
                    target=target,
                    headers=[
                        *kept,
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                )
                await guest.write(conn.send(request) + conn.send(h11.Data(data=body)))
                await guest.write(conn.send(h11.EndOfMessage()) or b"")
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await guest.read()
                        if guest.read_total > MAX_RESPONSE:
                            outcome = "cut"
                            break
                        conn.receive_data(data)
                        continue
                    if isinstance(event, h11.Response):
                        out = [(k, v) for k, v in event.headers if k.lower() not in HOP]
                        await send(
                            {
                                "type": "http.response.start",
                                "status": event.status_code,
                                "headers": out,
                            }
                        )
                        started = True
                    elif isinstance(event, h11.Data):
                        await send(
                            {
                                "type": "http.response.body",
                                "body": bytes(event.data),
                                "more_body": True,
                            }
                        )
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        break
        except PortUnreachable as exc:
            outcome, why = (
                "closed",
                f"The sandbox is running but port is not open ({port}): {exc}",
            )
        except (h11.ProtocolError, TimeoutError) as exc:
            outcome, why = "bad_answer", f"port {port}: no valid HTTP answer: {exc}"
        except CleanroomError as exc:
            outcome, why = "error", f"port {port}: {type(exc).__name__}: {exc}"
        self.counts.requests[("http", outcome)] += 1
        if started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif outcome == "cut":
            for m in _json(502, f"port {port}: the answer is over {MAX_RESPONSE} bytes"):
                await send(m)
        elif outcome != "ok":
            for m in _json(502, why):
                await send(m)
        else:
            for m in _json(502, f"port {port}: the guest closed without an answer"):
                await send(m)

    # -- WebSocket ----------------------------------------------------------------------------

    async def _websocket(
        self, scope: Scope, receive: Receive, send: Send, sbx: Sandbox, port: int
    ) -> None:
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        outcome = "ok"
        try:
            async with self._open(sbx, port) as guest:
                ws = WSConnection(ConnectionType.CLIENT)
                headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
                await guest.write(
                    ws.send(
                        Request(
                            host=headers.get("host", b"localhost").decode("latin-1"),
                            target=(scope.get("raw_path") or scope["path"].encode()).decode(
                                "latin-1"
                            )
                            + (
                                "?" + scope["query_string"].decode("latin-1")
                                if scope.get("query_string")
                                else ""
                            ),
                            subprotocols=list(scope.get("subprotocols") or []),
                        )
                    )
                )
                accepted = await self._handshake(ws, guest)
                if accepted is None:
                    outcome = "refused"
                    await send({"type": "websocket.close", "code": 1011})
                    return
                await send({"type": "websocket.accept", "subprotocol": accepted.subprotocol})
                await self._relay(ws, guest, receive, send)
        except PortUnreachable:
            outcome = "closed"
            await send({"type": "websocket.close", "code": 1011})
        except (TimeoutError, CleanroomError):
            outcome = "error"
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": 1011})
        finally:
            self.counts.requests[("websocket", outcome)] += 1

    async def _handshake(self, ws: WSConnection, guest: _Counted) -> AcceptConnection | None:
        while True:
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    return event
                if isinstance(event, RejectConnection):
                    return None
            data = await guest.read()
            if not data:
                return None
            ws.receive_data(data)

    async def _relay(self, ws: WSConnection, guest: _Counted, receive: Receive, send: Send) -> None:
        async def to_guest() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    with contextlib.suppress(Exception):
                        await guest.write(ws.send(CloseConnection(code=message.get("code", 1000))))
                    return
                data = message.get("bytes")
                if data is None:
                    data = message.get("text", "")
                if len(data) > MAX_MESSAGE or guest.stream.sent > MAX_RESPONSE:
                    await guest.write(ws.send(CloseConnection(code=1009)))
                    return
                await guest.write(ws.send(Message(data=data)))

        async def from_guest() -> None:
            parts: list[Any] = []
            size = 0
            while True:
                data = await guest.read(None)  # a WebSocket may idle as long as it likes
                if not data or guest.read_total > MAX_RESPONSE:
                    await send({"type": "websocket.close", "code": 1000 if not data else 1009})
                    return
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Ping):
                        await guest.write(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        with contextlib.suppress(Exception):
                            await guest.write(ws.send(event.response()))
                        await send({"type": "websocket.close", "code": event.code})
                        return
                    elif isinstance(event, TextMessage | BytesMessage):
                        parts.append(event.data)
                        size += len(event.data)
                        if size > MAX_MESSAGE:
                            await send({"type": "websocket.close", "code": 1009})
                            return
                        if event.message_finished:
                            if isinstance(event, TextMessage):
                                await send({"type": "websocket.send", "text": "".join(parts)})
                            else:
                                await send({"type": "websocket.send", "bytes": b"".join(parts)})
                            parts, size = [], 0

        up = asyncio.create_task(to_guest())
        down = asyncio.create_task(from_guest())
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
