"""Port proxy benchmark: an HTTP request through ``sandbox.get_host(port)`` against the same
request made directly, in the same run.

One ``cleanroom serve`` (fake driver: its guest is the host, so one ``python3 -m http.server``
on the host's loopback is both the guest's server and the direct reference), one sandbox of
the real e2b SDK, one persistent httpx client each way. Interleaved run by run:
  direct GET small / 1 MiB   (the client to the server's own port)
  proxied GET small / 1 MiB  (the client to ``cleanroom serve`` with Host ``get_host(port)``
                              and the traffic token: ASGI -> agent channel CONNECT -> the port)
and the proxied over direct ratio of each (p50s).
Results: bench/results/serve_ports.txt (``--out``).

    python bench/serve_ports.py [--runs 200]
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from served import free_port
from stats import Table, parser, write

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def _wait(url: str, proc: subprocess.Popen[bytes], what: str, **kw: object) -> None:
    end = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url, timeout=2, **kw).status_code in (200, 204):  # type: ignore[arg-type]
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end or proc.poll() is not None:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)


def main() -> None:
    p = parser(__doc__ or "", "serve_ports.txt", runs=200)
    args = p.parse_args()
    os.environ.setdefault("CLEANROOM_HOME", str(ROOT / ".cache" / "bench-home"))
    tmp = Path(tempfile.mkdtemp(prefix="serve-ports-bench-"))
    home = os.environ["CLEANROOM_HOME"]
    sys.path.insert(0, str(ROOT))
    from tests.server.kit import stored_fake_baseline  # resets CLEANROOM_HOME: put back

    os.environ["CLEANROOM_HOME"] = home
    from cleanroom.host import private
    from cleanroom.server.keys import KeyRing

    private.check_home()
    digest = stored_fake_baseline(tmp).digest
    www = tmp / "www"
    www.mkdir()
    (www / "small.txt").write_bytes(b"hello\n")
    (www / "blob.bin").write_bytes(os.urandom(MIB))
    web_port, serve_port = free_port(), free_port()
    web = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(web_port), "--bind", "127.0.0.1"],
        cwd=www,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = (tmp / "serve.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "cleanroom", "serve", "--port", str(serve_port), "--driver",
         "fake", "--template", f"b={digest}"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{serve_port}"
    try:
        _wait(url + "/health", server, "cleanroom serve")
        _wait(f"http://127.0.0.1:{web_port}/small.txt", web, "http.server")
        os.environ.update(
            {
                "E2B_API_URL": url,
                "E2B_SANDBOX_URL": url,
                "E2B_API_KEY": KeyRing().create("bench-ports")[1],
            }
        )
        from e2b import Sandbox

        sbx = Sandbox.create("b")
        headers = {
            "Host": sbx.get_host(web_port),
            "e2b-traffic-access-token": sbx.traffic_access_token or "",
        }
        rows: dict[str, list[float]] = {}
        with httpx.Client(timeout=60) as direct, httpx.Client(timeout=60) as proxied:

            def timed(name: str, client: httpx.Client, base: str, path: str, **kw: object) -> None:
                start = time.perf_counter()
                r = client.get(base + path, **kw)  # type: ignore[arg-type]
                took = time.perf_counter() - start
                assert r.status_code == 200, r.text[:300]
                rows.setdefault(name, []).append(took)

            for _ in range(args.runs):
                for path, size in (("/small.txt", "small"), ("/blob.bin", "1 MiB")):
                    timed(f"direct GET {size}", direct, f"http://127.0.0.1:{web_port}", path)
                    timed(f"proxied GET {size}", proxied, url, path, headers=headers)
        sbx.kill()
    finally:
        server.terminate()
        server.wait(120)
        web.terminate()
        web.wait(30)
    table = Table(("n", "p50", "p95", "p99", "min", "max"), 30)
    lines = [
        f"cleanroom serve port proxy benchmark (fake driver, {args.runs} runs interleaved; "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs shared, load "
        f"{os.getloadavg()[0]:.1f})",
        "",
        table.header("round trip (ms)"),
        *(table.row(name, rows[name]) for name in rows),
        "",
        "proxied over direct (p50)",
        table.ratio_row("small", rows["proxied GET small"], rows["direct GET small"]),
        table.ratio_row("1 MiB", rows["proxied GET 1 MiB"], rows["direct GET 1 MiB"]),
    ]
    write(args.out, lines)


if __name__ == "__main__":
    main()
