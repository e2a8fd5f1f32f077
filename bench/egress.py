"""Egress benchmark: what an allowlist costs a VM, measured from inside the guest.

On the tiny test baseline (qemu, cold boots: a networked VM always boots cold), same run:
  cold boot -> agent ready, without and with a NIC + egress proxy   (--boots each, alternating)
  connection through the HTTP proxy: CONNECT + a 1-byte echo        (--conns, in the guest)
  plain TCP to an allowed name: lookup, connect (synthetic address), echo  (--conns, guest)
  DNS lookup of an allowed name over TCP (getaddrinfo, A + AAAA)    (--conns, in the guest)
  bulk download through CONNECT                                     (--mib MiB, in the guest)
Each guest connection to a forward costs QEMU a short-lived helper process on the host
(``fdpass.py``); the per-connection times include it. Results: bench/results/egress.txt.

    python bench/egress.py [--boots 3] [--conns 30] [--mib 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Env, EnvRequest, Owner, new_env_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.host import hostproc
from cleanroom.network.policy import Policy
from cleanroom.network.proxy import EgressProxy
from cleanroom.observe.report import percentile

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "egress.txt"

GUEST = r"""
import json, os, socket, sys, time
host, port, conns, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
proxy = os.environ["HTTPS_PROXY"].removeprefix("http://").rsplit(":", 1)

def via_proxy(target):
    s = socket.create_connection((proxy[0], int(proxy[1])), timeout=30)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert b" 200 " in head, head
    return s

def timed(fn):
    out = []
    for _ in range(conns):
        t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1000)
    return out

def connect_echo():
    with via_proxy(f"{host}:{port}") as s:
        s.sendall(b"x"); assert s.recv(1) == b"x"

def tcp_echo():
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"x"); assert s.recv(1) == b"x"

def lookup():
    socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)

res = {"connect": timed(connect_echo), "tcp": timed(tcp_echo), "dns": timed(lookup)}
with via_proxy(f"{host}:{port + 1}") as s:
    s.sendall(b"%d\n" % mib); got, t = 0, time.perf_counter()
    while chunk := s.recv(1 << 20):
        got += len(chunk)
    res["bulk_mib_s"] = got / (1 << 20) / (time.perf_counter() - t)
print(json.dumps(res))
"""


async def serve(port: int = 0) -> tuple[asyncio.Server, asyncio.Server]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def bulk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mib = int((await reader.readline()).strip() or 0)
        block = bytes(1 << 20)
        for _ in range(mib):
            writer.write(block)
            await writer.drain()
        writer.close()

    for _ in range(20):  # two adjacent free ports: echo on P, bulk on P + 1
        first = await asyncio.start_server(echo, "127.0.0.1", 0)
        p = first.sockets[0].getsockname()[1]
        try:
            return first, await asyncio.start_server(bulk, "127.0.0.1", p + 1)
        except OSError:
            first.close()
    raise RuntimeError("no two adjacent free ports")


async def boot(
    driver: QemuDriver, baseline: Baseline, proxy: EgressProxy | None, env_id: str
) -> tuple[Env, float]:
    network = await proxy.start() if proxy else None
    limits = baseline.limits.merged_over(baseline.limits)
    request = EnvRequest(env_id, baseline, limits, Owner("bench"), 600, network=network)
    started = time.monotonic()
    env = await driver.create(request)
    return env, time.monotonic() - started


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--boots", type=int, default=3)
    parser.add_argument("--conns", type=int, default=30)
    parser.add_argument("--mib", type=int, default=32)
    args = parser.parse_args()
    baseline = resolve_or_build(str(ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"))
    driver = QemuDriver(start="cold")
    echo, bulk = await serve()
    port = echo.sockets[0].getsockname()[1]
    policy = Policy.parse([f"bench.test:{port}", f"bench.test:{port + 1}"])
    hosts = {"bench.test": "127.0.0.1"}
    boots: dict[str, list[float]] = {"plain": [], "networked": []}
    guest: dict[str, list[float]] = {"connect": [], "tcp": [], "dns": [], "bulk_mib_s": []}
    load = os.getloadavg()
    for _ in range(args.boots):
        env, seconds = await boot(driver, baseline, None, new_env_id())
        boots["plain"].append(seconds)
        await env.aclose()
        env_id = new_env_id()
        proxy = EgressProxy(policy, name=f"{hostproc.marker(env_id)}-egress", hosts=hosts)
        env, seconds = await boot(driver, baseline, proxy, env_id)
        boots["networked"].append(seconds)
        try:
            await env.put("/tmp/bench.py", GUEST.encode())
            argv = ["python3", "/tmp/bench.py", "bench.test", str(port)]
            result = await env.exec([*argv, str(args.conns), str(args.mib)], timeout_s=600)
            result.check()
            data = json.loads(result.stdout)
            for key in ("connect", "tcp", "dns"):
                guest[key] += data[key][1:]  # the first of each pays for cold code paths
            guest["bulk_mib_s"].append(data["bulk_mib_s"])
        finally:
            await env.aclose()
            await proxy.aclose()
    echo.close()
    bulk.close()
    lines = [
        f"# bench/egress.py, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
        f"{driver.accel.name if driver.accel else '?'}, load average before {load[0]:.2f}",
        f"# {args.boots} boots of each kind; {args.conns} connections per VM (first dropped)",
        "",
        "| what | p50 | p95 |",
        "|---|---|---|",
    ]
    for kind, values in boots.items():
        lines.append(
            f"| cold boot -> agent ready ({kind}) | {percentile(values, 50):.2f} s "
            f"| {percentile(values, 95):.2f} s |"
        )
    labels = {
        "connect": "CONNECT + 1-byte echo",
        "tcp": "plain TCP by name: lookup + connect + echo",
        "dns": "DNS lookup (A + AAAA over TCP)",
    }
    for key, label in labels.items():
        p50, p95 = percentile(guest[key], 50), percentile(guest[key], 95)
        lines.append(f"| {label} | {p50:.1f} ms | {p95:.1f} ms |")
    mean = statistics.mean(guest["bulk_mib_s"])
    lines.append(f"| bulk download through CONNECT ({args.mib} MiB) | {mean:.1f} MiB/s (mean) | |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    asyncio.run(main())
