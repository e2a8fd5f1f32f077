"""What the egress proxy does with each kind of guest connection (see ``proxy.py``).

A flow sees its proxy only as a ``FlowHost`` (the policy and plan it checks against, where it
records itself, how it connects out), so this module does not import ``proxy.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol
from urllib.parse import urlsplit

from cleanroom.network import dns
from cleanroom.network.events import Flow
from cleanroom.network.plan import Plan
from cleanroom.network.policy import Policy, as_address, normalize_name, split_target


class FlowHost(Protocol):
    """What a flow needs of the proxy serving it (``proxy.EgressProxy`` is one)."""

    policy: Policy
    plan: Plan

    def record(self, flow: Flow) -> None: ...

    async def connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, Any, str]: ...


REQUEST_TIMEOUT_S = 30.0  # to send a request head, or the next DNS query
CHUNK = 64 * 1024
DROP_HEADERS = (b"proxy-", b"connection:", b"keep-alive:")


class _Refused(Exception):
    """Answer the client with ``status`` and record ``reason``."""

    def __init__(self, status: bytes, reason: str) -> None:
        super().__init__(reason)
        self.status = status


async def serve_http(proxy: FlowHost, reader: asyncio.StreamReader, writer: Any) -> None:
    """One HTTP proxy request: CONNECT, or an absolute-form ``http://`` request."""
    flow = Flow("connect", "(no request)")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        lines = head[:-4].split(b"\r\n")
        method, target, version = _request_line(lines[0])
        flow.dest = target[:300]
        if method == b"CONNECT":
            host, port = _check_target(proxy, flow, target)
            first = b""
        else:
            flow.via = "http"
            host, port, path = _absolute_url(target)
            _check_target(proxy, flow, f"{host}:{port}" if ":" not in host else f"[{host}]:{port}")
            kept = [h for h in lines[1:] if not h.lower().startswith(DROP_HEADERS)]
            first = b"\r\n".join([method + b" " + path + b" " + version, *kept])
            first += b"\r\nConnection: close\r\n\r\n"
        up_reader, up_writer = await _connect(proxy, flow, host, port)
        if method == b"CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await relay(flow, reader, writer, up_reader, up_writer, first)
    except _Refused as refused:
        flow.reason = flow.reason if flow.allowed else str(refused)
        body = f"cleanroom egress: {refused}\n".encode()
        writer.write(
            b"HTTP/1.1 " + refused.status + b"\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError):
        flow.reason = "no complete request head"
    except ConnectionError as exc:
        flow.error = f"{type(exc).__name__}: {exc}"
    finally:
        proxy.record(flow)


def _request_line(line: bytes) -> tuple[bytes, str, bytes]:
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        raise _Refused(b"400 Bad Request", "not an HTTP request")
    return parts[0], parts[1].decode("latin-1"), parts[2]


def _absolute_url(target: str) -> tuple[str, int, bytes]:
    try:
        url = urlsplit(target)
        port = url.port or 80
    except ValueError:
        url, port = None, 0
    if url is None or url.scheme != "http" or not url.hostname:
        raise _Refused(b"400 Bad Request", "only CONNECT and absolute http:// requests are proxied")
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return url.hostname, port, path.encode("latin-1")


def _check_target(proxy: FlowHost, flow: Flow, target: str) -> tuple[str, int]:
    """Parse ``host:port`` and check it against the allowlist (sets the flow's verdict)."""
    flow.dest = target[:300]
    try:
        host, port = split_target(target)
    except ValueError as exc:
        raise _Refused(b"400 Bad Request", f"bad target: {exc}") from exc
    host = host.lower()
    if as_address(host) is None and normalize_name(host) is None:
        raise _Refused(b"400 Bad Request", "bad target: not a DNS name or an address")
    rule = proxy.policy.match(host, port)
    if rule is None:
        raise _Refused(b"403 Forbidden", f"{flow.dest} is not on the allowlist")
    flow.allowed, flow.rule, flow.reason = True, str(rule), f"allowed by {rule}"
    return host, port


async def _connect(proxy: FlowHost, flow: Flow, host: str, port: int) -> tuple[Any, Any]:
    try:
        reader, writer, flow.address = await proxy.connect(host, port)
    except (OSError, TimeoutError) as exc:
        flow.error = f"connect failed: {type(exc).__name__}: {exc}"
        raise _Refused(b"502 Bad Gateway", flow.error) from exc
    return reader, writer


async def serve_tcp(
    proxy: FlowHost, dest: tuple[str, int], reader: asyncio.StreamReader, writer: Any
) -> None:
    """A plain TCP connection to a synthetic address: relayed to its name and port."""
    host, port = dest
    flow = Flow("tcp", f"{host}:{port}")
    try:
        rule = proxy.policy.match(host, port)
        if rule is None:  # the plan only holds allowed names; checked again all the same
            flow.reason = f"{flow.dest} is not on the allowlist"
            return
        flow.allowed, flow.rule, flow.reason = True, str(rule), f"allowed by {rule}"
        try:
            up_reader, up_writer, flow.address = await proxy.connect(host, port)
        except (OSError, TimeoutError) as exc:
            flow.error = f"connect failed: {type(exc).__name__}: {exc}"
            return
        await relay(flow, reader, writer, up_reader, up_writer)
    finally:
        proxy.record(flow)


async def relay(
    flow: Flow, reader: Any, writer: Any, up_reader: Any, up_writer: Any, first: bytes = b""
) -> None:
    """Copy both ways, counting bytes into ``flow``, until both sides have closed (an EOF is
    passed on as one) or either fails (then both are cut)."""

    async def copy(src: Any, dst: Any, up: bool) -> None:
        while data := await src.read(CHUNK):
            dst.write(data)
            if up:
                flow.up += len(data)
            else:
                flow.down += len(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()

    tasks = [
        asyncio.ensure_future(copy(reader, up_writer, True)),
        asyncio.ensure_future(copy(up_reader, writer, False)),
    ]
    try:
        if first:
            up_writer.write(first)
            flow.up += len(first)
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t.exception() for t in done if t.exception() is not None]
        if failed:
            flow.error = flow.error or f"{type(failed[0]).__name__}: {failed[0]}"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        up_writer.close()


async def serve_dns(proxy: FlowHost, reader: asyncio.StreamReader, writer: Any) -> None:
    """DNS over TCP: length-prefixed queries, one answer each, until the guest stops."""
    while True:
        try:
            size = int.from_bytes(
                await asyncio.wait_for(reader.readexactly(2), REQUEST_TIMEOUT_S), "big"
            )
            if not 12 <= size <= dns.MAX_MESSAGE:
                return
            message = await reader.readexactly(size)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            return
        answer = answer_dns(proxy, message)
        writer.write(len(answer).to_bytes(2, "big") + answer)
        try:
            await writer.drain()
        except ConnectionError:
            return


def answer_dns(proxy: FlowHost, message: bytes) -> bytes:
    """The answer to one query, recorded as a ``dns`` event."""
    flow = Flow("dns")
    flow.up = len(message)
    try:
        query = dns.parse_query(message)
    except dns.BadQuery as bad:
        flow.dest, flow.reason = "(malformed query)", str(bad)
        answer = dns.error_response(bad)
    else:
        flow.dest = f"{query.name[:300]} {query.type_name}"
        answer = _resolve(proxy, flow, query)
    flow.down = len(answer)
    proxy.record(flow)
    return answer


def _resolve(proxy: FlowHost, flow: Flow, query: dns.Query) -> bytes:
    name = normalize_name(query.name)
    rules = [r for r in proxy.policy.rules if name and r.kind != "net" and r.matches(name, r.port)]
    if not rules:
        flow.reason = "not on the allowlist"
        return dns.response(query, dns.NXDOMAIN)
    flow.allowed, flow.rule = True, str(rules[0])
    address = proxy.plan.addresses.get(name or "")
    if address is not None and query.qtype == dns.TYPE_A and query.qclass == 1:
        flow.reason, flow.address = "allowed: its synthetic address", address
        return dns.response(query, dns.NOERROR, address)
    flow.reason = (
        "allowed: no such record (A only)"
        if address is not None
        else "allowed through the HTTP proxy only: no address"
    )
    return dns.response(query, dns.NOERROR)
