"""Serve benchmark: the real e2b SDK through ``cleanroom serve`` beside the same run's session.

Measures, interleaved run by run (a served sandbox, then a native ``cr.session`` on the same
driver and baseline, in this process):
  create -> first command     (``Sandbox.create`` + ``commands.run("true")`` / ``async with
                               session(...)`` + ``commands.run(["/bin/bash", "-l", "-c",
                               "true"])``: the argv the SDK sends)
  repeated command            (``true`` again, --cmds per sandbox)
  1 MiB write + read          (one 1 MiB file there and back, 3 per sandbox)
  kill / close                (the call that ends it: returns once the env is confirmed absent)
Then --burst sandboxes created at once (threads, one key; per-key limits raised), their create
latencies (p50/p99), how many succeeded, and the server's RSS with all of them alive.
Each served row is also given as a ratio to its native reference (issue 31's targets: first
command <= 1.5x, repeated command <= 2x, 1 MiB round trip <= 2x).
Results: bench/results/serve.txt (``--out``). The fake driver by default (no VM: the server's
own overhead shows); ``--driver qemu --baseline tests/baselines/tiny/baseline.toml`` for VMs.

    python bench/serve.py [--runs 20] [--cmds 30] [--burst 64] [--driver fake]
"""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from served import start_server
from stats import Table, parser, ratio, write

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
ROUND_TRIPS = 3


def _fake_baseline(tmp: Path) -> str:
    """A fake-driver baseline in the home's store (the suite's recipe); its digest."""
    home = os.environ["CLEANROOM_HOME"]
    sys.path.insert(0, str(ROOT))
    from tests.server.kit import stored_fake_baseline  # resets CLEANROOM_HOME: put back

    os.environ["CLEANROOM_HOME"] = home
    return stored_fake_baseline(tmp).digest


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def served_run(cmds: int, blob: bytes, path: str) -> dict[str, list[float]]:
    from e2b import Sandbox

    out: dict[str, list[float]] = {"first": [], "cmd": [], "rt": [], "end": []}
    t0 = time.perf_counter()
    sbx = Sandbox.create("b")
    sbx.commands.run("true")
    out["first"].append(time.perf_counter() - t0)
    for _ in range(cmds):
        t = time.perf_counter()
        sbx.commands.run("true")
        out["cmd"].append(time.perf_counter() - t)
    for _ in range(ROUND_TRIPS):
        t = time.perf_counter()
        sbx.files.write(path, blob)
        assert len(sbx.files.read(path, format="bytes")) == len(blob)
        out["rt"].append(time.perf_counter() - t)
    t = time.perf_counter()
    sbx.kill()
    out["end"].append(time.perf_counter() - t)
    return out


async def native_run(baseline: Any, driver: Any, cmds: int, blob: bytes, path: str) -> Any:
    from cleanroom.lifecycle.context import RunOptions
    from cleanroom.sessions import session

    out: dict[str, list[float]] = {"first": [], "cmd": [], "rt": [], "end": []}
    argv = ["/bin/bash", "-l", "-c", "true"]
    t0 = time.perf_counter()
    block = session(baseline, driver=driver, options=RunOptions(spares=0))
    sb = await block.__aenter__()
    try:
        await sb.commands.run(argv)
        out["first"].append(time.perf_counter() - t0)
        for _ in range(cmds):
            t = time.perf_counter()
            await sb.commands.run(argv)
            out["cmd"].append(time.perf_counter() - t)
        for _ in range(ROUND_TRIPS):
            t = time.perf_counter()
            await sb.files.write(path, blob)
            assert len(await sb.files.read(path)) == len(blob)
            out["rt"].append(time.perf_counter() - t)
        sb.finish(0.0)
    finally:
        t = time.perf_counter()
        await block.__aexit__(None, None, None)
        out["end"].append(time.perf_counter() - t)
    return out


def burst(n: int) -> tuple[list[float], int, list[Any]]:
    from e2b import Sandbox

    def timed(_: int) -> tuple[float, Any]:
        t = time.perf_counter()
        try:
            sbx: Any = Sandbox.create("b", timeout=600)
        except Exception as exc:  # counted: every one must succeed
            sbx = exc
        return time.perf_counter() - t, sbx

    with ThreadPoolExecutor(n) as pool:
        done = list(pool.map(timed, range(n)))
    ok = [s for _, s in done if not isinstance(s, Exception)]
    return [d for d, _ in done], len(ok), ok


def main() -> None:
    p = parser(__doc__ or "", "serve.txt", runs=20)
    p.add_argument("--cmds", type=int, default=30)
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--driver", default="fake")
    p.add_argument("--baseline", default=None, help="baseline ref (default: a fake baseline)")
    args = p.parse_args()
    os.environ.setdefault("CLEANROOM_HOME", str(ROOT / ".cache" / "bench-home"))
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    from cleanroom.host import private

    private.check_home()
    if args.baseline is None:
        digest = _fake_baseline(tmp)
    else:
        from cleanroom.baseline.resolve import resolve_or_build

        digest = resolve_or_build(args.baseline).digest
    from cleanroom.baseline.store import load
    from cleanroom.drivers import get_driver
    from cleanroom.server.keys import KeyRing

    baseline = load(digest)
    driver = get_driver(args.driver)
    n = str(max(args.burst, 16) * 2)
    server, url = start_server(
        ["--driver", args.driver, "--template", f"b={digest}", "--per-key", n, "--burst", n,
         "--creates-per-s", "1000", "--max-sandboxes", n],
        tmp / "serve.log",
        60,
    )  # fmt: skip
    os.environ.update(
        {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": KeyRing().create("bench")[1]}
    )
    blob = os.urandom(MIB)
    path = str(tmp / "blob") if args.driver == "fake" else "/tmp/blob"
    served: dict[str, list[float]] = {"first": [], "cmd": [], "rt": [], "end": []}
    native: dict[str, list[float]] = {"first": [], "cmd": [], "rt": [], "end": []}
    try:
        for _ in range(args.runs):
            for k, v in served_run(args.cmds, blob, path).items():
                served[k] += v
            got = asyncio.run(native_run(baseline, driver, args.cmds, blob, path))
            for k, v in got.items():
                native[k] += v
        created, ok, alive = burst(args.burst)
        rss = _rss_mib(server.pid)
        with ThreadPoolExecutor(len(alive) or 1) as pool:
            list(pool.map(lambda s: s.kill(), alive))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    table = Table(("n", "p50", "p95", "p99", "min", "max"), 46)
    lines = [
        f"cleanroom serve benchmark ({args.driver} driver, e2b SDK {_e2b_version()}, "
        f"{platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')})",
        f"runs {args.runs}, {args.cmds} repeated commands and {ROUND_TRIPS} 1 MiB round trips "
        "each; ms",
        table.header("path"),
    ]
    names = {
        "first": "create -> first command",
        "cmd": "repeated commands.run('true')",
        "rt": "1 MiB write + read",
        "end": "kill / close (env confirmed absent)",
    }
    for k, name in names.items():
        lines.append(table.row(f"served: {name}", served[k]))
        lines.append(table.row(f"native: {name}", native[k]))
    lines.append("served / native (p50):")
    targets = {"first": 1.5, "cmd": 2.0, "rt": 2.0, "end": None}
    for k, name in names.items():
        limit = targets[k]
        verdict = "" if limit is None else f"  (target <= {limit}x)"
        lines.append(f"  {name:<40} {ratio(served[k], native[k]):.2f}{verdict}")
    lines.append(table.header(f"{args.burst} creates at once"))
    lines.append(table.row("create latency", created))
    lines.append(f"succeeded: {ok}/{args.burst}; server RSS with them alive: {rss:.0f} MiB")
    write(args.out, lines)


def _e2b_version() -> str:
    from importlib.metadata import version

    return version("e2b")


if __name__ == "__main__":
    main()
