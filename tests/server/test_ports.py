"""``sandbox.get_host(port)`` of the real ``e2b`` SDK against ``cleanroom serve`` (fake driver):
HTTP and WebSocket to servers in the sandbox, proxied over the agent channel
(``server/ports.py``, the native agent's CONNECT). The fake driver's guest is the host, so its
127.0.0.1 is the host's: the servers are started on the host by the test (a command through the
SDK runs a login shell, which here can wait a minute on pyenv's lock); ``test_vm.py`` starts
them in a real guest through the SDK."""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from .kit import Server, WsRefused, free_port, new_key, via_host, wait_http, ws_echo

HERE = Path(__file__).parent


@contextlib.contextmanager
def serving(argv: list[str], cwd: Path) -> Iterator[int]:
    """A server ``argv + [port]`` on the host's loopback, once it listens (by a deadline)."""
    port = free_port()
    proc = subprocess.Popen([*argv, str(port)], cwd=cwd, stdout=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < end, "the server did not start"
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def _metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE))


def test_get_host_reaches_http_servers_in_the_sandbox(
    server: Server, key: str, tmp_path: Path
) -> None:
    """Protects: a file from ``python3 -m http.server`` in the sandbox comes back whole through
    ``get_host(port)``; a POST body goes up whole; the path and query reach the guest; the
    traffic token and the API key never do; the E2B header form (``E2b-Sandbox-Id`` +
    ``E2b-Sandbox-Port``) routes too; the bytes are counted in /metrics."""
    sbx = Sandbox.create("fake")
    assert sbx.traffic_access_token
    blob = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "blob.bin").write_bytes(blob)
    shutil.copy(HERE / "httpecho.py", tmp_path / "httpecho.py")
    with (
        serving([sys.executable, "-m", "http.server", "--bind", "127.0.0.1"], tmp_path) as files,
        serving([sys.executable, "httpecho.py"], tmp_path) as echo,
    ):
        _through_the_proxy(server, sbx, files, echo, blob)
    sbx.kill()


def _through_the_proxy(server: Server, sbx: Sandbox, files: int, echo: int, blob: bytes) -> None:
    auth = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
    before = _metric(server, 'cleanroom_serve_port_bytes_total{direction="from_guest"}')

    host = sbx.get_host(files)
    assert host.startswith(f"{files}-{sbx.sandbox_id}.")
    r = wait_http(server, host, auth)
    assert r.status_code == 200, r.text
    r = via_host(server, host, path="/blob.bin", headers=auth)
    assert r.status_code == 200 and r.content == blob

    echo_host = sbx.get_host(echo)
    assert wait_http(server, echo_host, auth).status_code == 200
    r = via_host(server, echo_host, path="/a/b?x=1&y=%20", headers={**auth, "X-Mine": "kept"})
    seen = r.json()
    assert seen["path"] == "/a/b?x=1&y=%20" and seen["headers"]["x-mine"] == "kept"
    assert seen["headers"]["host"] == echo_host
    assert not {"e2b-traffic-access-token", "x-api-key"} & set(seen["headers"])
    body = b"\x00\xff" * 700_000
    r = via_host(server, echo_host, "POST", "/up", headers=auth, content=body)
    assert r.json() == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}

    by_headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(echo), **auth}
    r = httpx.get(server.url + "/via-headers", headers=by_headers, timeout=60)
    assert r.status_code == 200 and r.json()["path"] == "/via-headers"

    after = _metric(server, 'cleanroom_serve_port_bytes_total{direction="from_guest"}')
    assert after - before >= len(blob)
    assert _metric(server, 'cleanroom_serve_port_bytes_total{direction="to_guest"}') >= len(body)


def test_a_port_needs_the_sandboxs_token_or_key_and_a_closed_port_is_502(
    server: Server, key: str, tmp_path: Path
) -> None:
    """Protects: no token, a wrong token, another key's token or API key: the unknown
    sandbox's 404 (nothing reaches the guest); the owner's API key works; a port nothing
    listens on is a clean 502 in E2B's JSON; a body over --max-body-mib is 413; envd's own
    port (49983) in the Host is still envd, not the proxy."""
    sbx = Sandbox.create("fake")
    other = Sandbox.create("fake", api_key=new_key("other"))
    shutil.copy(HERE / "httpecho.py", tmp_path / "httpecho.py")
    with serving([sys.executable, "httpecho.py"], tmp_path) as port:
        _refusals(server, sbx, other, key, port)
    sbx.kill()
    other.kill()


def _refusals(server: Server, sbx: Sandbox, other: Sandbox, key: str, port: int) -> None:
    host = sbx.get_host(port)
    good = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
    assert wait_http(server, host, good).status_code == 200

    for headers in (
        {},
        {"e2b-traffic-access-token": "wrong"},
        {"e2b-traffic-access-token": other.traffic_access_token or ""},
        {"X-API-Key": new_key("stranger")},
    ):
        r = via_host(server, host, headers=headers)
        assert r.status_code == 404 and "not found" in r.json()["message"], headers
    assert via_host(server, host, headers={"X-API-Key": key}).status_code == 200

    closed = via_host(server, sbx.get_host(free_port()), headers=good)
    assert closed.status_code == 502
    assert closed.json()["code"] == 502 and "not open" in closed.json()["message"]

    big = via_host(server, host, "POST", "/", headers=good, content=b"x" * (5 << 20))
    assert big.status_code == 413

    envd = via_host(server, f"49983-{sbx.sandbox_id}.e2b.app", path="/health")
    assert envd.status_code == 204
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'cleanroom_serve_port_requests_total{kind="http",outcome="closed"}' in text


def test_a_websocket_echo_in_the_sandbox(server: Server, key: str, tmp_path: Path) -> None:
    """Protects: a WebSocket to ``get_host(port)`` is relayed both ways (text and binary
    messages, one past a chunk of the channel) to a server in the sandbox; without the token
    the handshake is refused."""
    sbx = Sandbox.create("fake")
    shutil.copy(HERE / "wsecho.py", tmp_path / "wsecho.py")
    with serving([sys.executable, "wsecho.py"], tmp_path) as port:
        host = sbx.get_host(port)
        auth = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
        messages: list[str | bytes] = ["hello", b"\x00\x01binary", "é" * 10, b"z" * 300_000]
        assert ws_echo(server, host, auth, messages) == messages
        with pytest.raises(WsRefused):
            ws_echo(server, host, {}, ["x"])
    sbx.kill()
