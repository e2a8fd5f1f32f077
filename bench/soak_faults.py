"""The soak's fault machinery (``bench/soak.py``): what it runs beside the rounds.

- ``FaultyS3``: moto's S3 server (a subprocess on loopback) behind a proxy that, while told to,
  answers a share of the requests with 500 / 503 or stalls them past the client's read timeout
  (before or after passing them on: a write that happened but whose answer never came);
- ``Tmpfs``: a size-limited tmpfs (root only) and a filler that takes all its room at once;
- ``Served``: a ``cleanroom serve`` subprocess (the fake driver) that can be SIGKILLed and
  started again;
- ``RayNodes``: a local Ray cluster on loopback whose nodes (each its own home) can be added
  and SIGKILLed.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

READ_TIMEOUT_S = 2  # the S3 client's, set through fsspec's config (FSSPEC_S3)
STALL_S = READ_TIMEOUT_S + 1.5
HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} not ready in {timeout_s} s")


# -- S3 with faults ---------------------------------------------------------------------------


class FaultyS3:
    """moto's server behind a fault-injecting proxy; ``url`` is the proxy (the endpoint the
    store is given). ``faults(mode, share)``: ``ok``, ``5xx`` or ``stall``, for ``share`` of the
    requests (drawn from ``seed``); ``counts`` says what was injected."""

    def __init__(self, seed: int, log: Path) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.mode, self.share = "ok", 0.0
        self.counts: dict[str, int] = {}
        port = free_port()
        self.upstream = ("127.0.0.1", port)
        self.moto = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        wait_http(f"http://127.0.0.1:{port}/moto-api/", self.moto, "moto")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None  # type: ignore[method-assign]  # a client gone
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        """What a process needs to reach this S3 (and give up on a stalled call soon)."""
        import json

        conf = {
            "config_kwargs": {
                "read_timeout": READ_TIMEOUT_S,
                "connect_timeout": READ_TIMEOUT_S,
                "retries": {"max_attempts": 3, "mode": "standard"},
            }
        }
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            # whole bodies with a Content-Length (no aws-chunked streaming) through the proxy
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "FSSPEC_S3": json.dumps(conf),
        }

    def configure_here(self) -> None:
        """This process: the env, and fsspec's config (read at its import) set now too."""
        import json

        os.environ.update(self.env())
        import fsspec.config

        fsspec.config.conf["s3"] = json.loads(os.environ["FSSPEC_S3"])

    def bucket(self, name: str) -> None:
        req = urllib.request.Request(f"http://{self.upstream[0]}:{self.upstream[1]}/{name}")
        req.method = "PUT"
        urllib.request.urlopen(req, timeout=30).close()

    def faults(self, mode: str, share: float) -> None:
        with self.lock:
            self.mode, self.share = mode, share

    def _draw(self) -> str:
        with self.lock:
            if self.mode == "ok" or self.rng.random() >= self.share:
                return "pass"
            kind = self.mode
            if kind == "stall":
                kind = self.rng.choice(("stall before", "stall after"))
            else:
                kind = self.rng.choice(("500", "503"))
            self.counts[kind] = self.counts.get(kind, 0) + 1
            return kind

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes | None:
                """The request's body; None when the client sent less than it announced."""
                if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
                    parts: list[bytes] = []
                    while True:
                        line = self.rfile.readline()
                        if not line:
                            return None
                        size = int(line.split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline().strip():  # trailers
                                pass
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        if len(parts[-1]) < size:
                            return None
                        self.rfile.readline()
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                return body if len(body) == length else None

            def _any(self) -> None:
                body = self._body()
                if body is None:  # the client gave up mid-body: S3 stores nothing either
                    self.close_connection = True
                    return
                fault = proxy._draw()
                if fault in ("500", "503"):
                    code = "InternalError" if fault == "500" else "SlowDown"
                    msg = f"<Error><Code>{code}</Code><Message>soak</Message></Error>".encode()
                    self.send_response(int(fault))
                    self.send_header("content-type", "application/xml")
                    self.send_header("content-length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if fault == "stall before":
                    time.sleep(STALL_S)
                    self.close_connection = True
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                    headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if fault == "stall after":  # done upstream; its answer never comes
                    time.sleep(STALL_S)
                    self.close_connection = True
                    return
                self.send_response(resp.status)
                head = self.command == "HEAD"  # its Content-Length is the object's
                for k, v in resp.getheaders():
                    if k.lower() not in HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("content-length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.moto.terminate()
        try:
            self.moto.wait(30)
        except subprocess.TimeoutExpired:
            self.moto.kill()
            self.moto.wait()


# -- a disk that fills up ---------------------------------------------------------------------


class Tmpfs:
    """A tmpfs of ``size`` at ``path`` (root only); ``fill()`` takes all its room at once,
    ``free()`` gives it back."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True
        )
        self.filler = path / ".filler"

    def fill(self) -> None:
        with self.filler.open("ab") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
            try:  # the last partial blocks too
                while True:
                    f.write(b"\0" * 512)
                    f.flush()
            except OSError:
                pass

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


# -- a served cleanroom -----------------------------------------------------------------------


class Served:
    """``cleanroom serve`` (the fake driver, template ``b``) on a free loopback port."""

    def __init__(self, digest: str, log: Path) -> None:
        self.digest, self.log = digest, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "cleanroom", "serve", "--port", str(self.port)]
        cmd += ["--driver", "fake", "--template", f"b={self.digest}", "--per-key", "64"]
        cmd += ["--burst", "64", "--creates-per-s", "1000", "--max-sandboxes", "64"]
        self.starts += 1
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_http(self.url + "/health", self.proc, "cleanroom serve")

    def kill(self) -> None:
        """SIGKILL: no cleanup of its own."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        """SIGTERM: every sandbox ended; its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(180)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# -- a Ray cluster whose nodes die --------------------------------------------------------------

RAY_ENV = {  # read when Ray is imported: set before
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every address on loopback
}
RAY_HEALTH = {  # a dead node noticed in ~2 s, not Ray's default 30 s
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 500,
    "health_check_initial_delay_ms": 0,
}


class RayNodes:
    """A local Ray cluster (``ray.cluster_utils``) on loopback: a head with no CPUs and one
    standing node, each node with its own ``CLEANROOM_HOME`` under ``root`` and 2
    ``cleanroom_vm`` slots; this process connected to it. ``add`` starts another node,
    ``kill`` SIGKILLs a node's raylet (its workers and envs die with it)."""

    def __init__(self, root: Path) -> None:
        for key, value in RAY_ENV.items():
            os.environ.setdefault(key, value)
        import ray
        from ray import cluster_utils

        self.root = root
        self.homes: dict[str, Path] = {}
        self._nodes: dict[str, Any] = {}
        self.cluster = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "node_ip_address": "127.0.0.1",
                "_system_config": RAY_HEALTH,
            },
        )
        self.add("standing")
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.address = str(self.cluster.address)

    def add(self, name: str) -> Path:
        """A new node named ``name`` (its home returned), its agent already built."""
        home = self.root / name
        (home / "cache" / "agent").mkdir(parents=True)
        from cleanroom.agent import native

        built = native.host_binary().parent  # this process's home's build: hard-linked
        shutil.copytree(built, home / "cache" / "agent" / built.name, copy_function=os.link)
        self._nodes[name] = self.cluster.add_node(
            num_cpus=1,
            resources={"cleanroom_vm": 2},
            node_ip_address="127.0.0.1",
            env_vars={"CLEANROOM_HOME": str(home)},
        )
        self.homes[name] = home
        return home

    def kill(self, name: str) -> None:
        raylet = self._nodes[name].all_processes["raylet"][0].process
        os.kill(raylet.pid, signal.SIGKILL)

    def remove(self, name: str) -> None:
        node = self._nodes.pop(name)
        with contextlib.suppress(Exception):  # already dead by our own SIGKILL
            self.cluster.remove_node(node, allow_graceful=False)

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
