"""A ``cleanroom serve`` subprocess on a free loopback port, and what the tests check after it.

The SDK under test is the real ``e2b`` package, configured only by ``E2B_API_URL``,
``E2B_SANDBOX_URL`` and ``E2B_API_KEY`` (``Server.sdk_env``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import RunFolderDriver
from cleanroom.host import paths
from cleanroom.ledger import Ledger
from cleanroom.server.keys import KeyRing
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline
from ..vmkit import assert_gone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stored_fake_baseline(tmp: Path) -> Baseline:
    """A fake-driver baseline, copied into the home's store so a digest names it."""
    baseline = make_fake_baseline(tmp)
    dest = paths.baselines_dir() / baseline.digest.removeprefix("sha256:")
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(baseline.path, dest)
    return baseline


class Server:
    """``cleanroom serve`` with ``args``; ``stop`` sends SIGTERM and waits for its exit."""

    def __init__(
        self, args: list[str], log: Path, ca: Path | None = None, ready_s: float = 60.0
    ) -> None:
        """``ca``: the server serves TLS (``args`` name its cert and key), trusted by ``ca``."""
        self.port = free_port()
        self.url = f"{'https' if ca else 'http'}://127.0.0.1:{self.port}"
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
        self.log = log
        cmd = [sys.executable, "-m", "cleanroom", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        self._wait_ready(ready_s)

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited: {self.log.read_text()}")
            try:
                ok = httpx.get(self.url + "/health", timeout=2, verify=self.verify)
                if ok.status_code == 204:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"serve not ready in {timeout_s}s: {self.log.read_text()}")

    def sdk_env(self, key: str) -> dict[str, str]:
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": key}

    def stop(self, timeout_s: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"serve did not stop on SIGTERM: {self.log.read_text()}") from exc


def steps(store: LocalStore, run_id: str, eid: str, attempt: int) -> list[dict[str, Any]]:
    """The durable transcript of attempt ``attempt`` of a sandbox's session."""
    base = Path(store.episode_uri(run_id, eid).removeprefix("file://"))
    path = base / "attempts" / str(attempt) / "logs" / "transcript.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def new_key(name: str = "test") -> str:
    return KeyRing().create(name)[1]


def outcome(sandbox_id: str, driver: RunFolderDriver | None = None, timeout_s: float = 60.0) -> str:
    """The sandbox's session outcome once final, after checking its env is confirmed absent
    in the ledger (and gone from the host, with ``driver``)."""
    run_id = f"serve-{sandbox_id}"
    end = time.monotonic() + timeout_s
    with Ledger() as ledger:
        while True:
            rows = ledger.episodes(run_id)
            envs = ledger.envs(run_id=run_id)
            done = rows and rows[0].outcome and envs and all(e.confirmed_absent_at for e in envs)
            if done:
                break
            if time.monotonic() > end:
                raise AssertionError(f"{run_id}: no final outcome: {rows} {envs}")
            time.sleep(0.05)
        if driver is not None:
            for env in envs:
                assert_gone(driver, env.env_id)
        return str(rows[0].outcome)


def via_host(server: Server, host: str, method: str = "GET", path: str = "/", **kw: Any) -> Any:
    """An HTTP request for ``host`` (what ``sandbox.get_host(port)`` returns) sent to the
    server's address: what DNS naming ``*.{domain}`` the server would deliver."""
    headers = {"Host": host, **kw.pop("headers", {})}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kw)


def wait_http(server: Server, host: str, headers: dict[str, str], timeout_s: float = 60.0) -> Any:
    """The first answer that is not the proxy's 502 (the guest server is up), by a deadline."""
    end = time.monotonic() + timeout_s
    while True:
        r = via_host(server, host, headers=headers)
        if r.status_code != 502 or time.monotonic() > end:
            return r
        time.sleep(0.1)


class WsRefused(Exception):
    """The WebSocket handshake was refused (or the connection closed before it)."""


def ws_echo(server: Server, host: str, headers: dict[str, str], messages: list[Any]) -> list[Any]:
    """A WebSocket client (wsproto on a socket) for ``host`` through the server: each message
    sent, each answer read back, then a clean close."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import (
        AcceptConnection,
        BytesMessage,
        CloseConnection,
        Message,
        Request,
        TextMessage,
    )

    ws = WSConnection(ConnectionType.CLIENT)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    queued: list[Any] = []

    def next_event() -> Any:
        while not queued:
            data = sock.recv(65536)
            if not data:
                raise WsRefused("the server closed the connection")
            ws.receive_data(data)
            queued.extend(ws.events())
        return queued.pop(0)

    try:
        extra = [(k.encode(), v.encode()) for k, v in headers.items()]
        sock.sendall(ws.send(Request(host=host, target="/echo", extra_headers=extra)))
        first = next_event()
        if not isinstance(first, AcceptConnection):
            raise WsRefused(repr(first))
        answers: list[Any] = []
        for message in messages:
            sock.sendall(ws.send(Message(data=message)))
            parts = []
            while True:
                event = next_event()
                if isinstance(event, CloseConnection):
                    raise AssertionError(f"closed by the server: {event.code} {event.reason}")
                assert isinstance(event, TextMessage | BytesMessage), event
                parts.append(event.data)
                if event.message_finished:
                    break
            answers.append("".join(parts) if isinstance(message, str) else b"".join(parts))
        sock.sendall(ws.send(CloseConnection(code=1000)))
        return answers
    finally:
        sock.close()
