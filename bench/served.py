"""``cleanroom serve`` as a subprocess for the server benchmarks: on a free loopback port,
returned once it answers ``/health``, stopped by SIGTERM (its sandboxes end and are confirmed
absent before it exits)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    args: list[str], log: Path, ready_s: float = 120.0
) -> tuple[subprocess.Popen[bytes], str]:
    """``cleanroom serve ARGS`` (its output in ``log``) and its URL, once ready."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "cleanroom", "serve", "--port", str(port), *args]
    server = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + ready_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 204:
                return server, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > end or server.poll() is not None:
            server.kill()
            raise SystemExit(f"serve did not start: {log.read_text()}")
        time.sleep(0.05)


def stop_server(server: subprocess.Popen[bytes], wait_s: float = 300.0) -> int:
    """SIGTERM, then its exit status (SIGKILL past ``wait_s``)."""
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(wait_s)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.wait()
