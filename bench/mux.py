"""The multiplexed agent protocol on a qemu env (issue 16), each row against a same-run reference.

One env of the tiny baseline (native agent); per run, interleaved:
  exec `true`                  reference: `true` as a host subprocess
  4 x `sleep 0.5` at once      reference: the same 4 one after the other in the same env
  64 MiB put_stream, get_stream   reference: a host file copy of the same 64 MiB
Every row also as a ratio to its reference (p50). Results: bench/results/mux.txt.

    python bench/mux.py [--runs 10]
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from start import ROOT, request
from stats import Table, p50, parser, timed, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.drivers.qemu import QemuDriver

BLOCK = os.urandom(1 << 20)
ROWS = (
    ("true", "exec `true`", "host subprocess `true`"),
    ("sleeps", "4 x sleep 0.5 at once", "4 x sleep 0.5 in turn"),
    ("put", "64 MiB put_stream", "host copy of 64 MiB"),
    ("get", "64 MiB get_stream", "host copy of 64 MiB"),
)


async def blocks() -> AsyncIterator[bytes]:
    for _ in range(64):
        yield BLOCK


async def main() -> None:
    args = parser(__doc__, "mux.txt", runs=10).parse_args()
    load_at_start = os.getloadavg()[0]
    baseline = resolve_or_build(str(ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"))
    driver = QemuDriver()
    env = await driver.create(request(baseline))
    times: dict[str, list[float]] = {k: [] for row in ROWS for k in (row[0], row[0] + "-ref")}

    async def host_true() -> None:
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()

    async def put() -> None:
        await env.put_stream("/tmp/big", blocks())

    async def get() -> None:
        async for _ in env.get_stream("/tmp/big"):
            pass

    async def at_once() -> None:
        await asyncio.gather(*(env.exec(["sleep", "0.5"]) for _ in range(4)))

    async def in_turn() -> None:
        for _ in range(4):
            await env.exec(["sleep", "0.5"])

    with tempfile.TemporaryDirectory(prefix="bench-mux-") as tmp:
        src, dst = Path(tmp) / "a", Path(tmp) / "b"
        src.write_bytes(BLOCK * 64)

        async def host_copy() -> None:
            await asyncio.to_thread(shutil.copyfile, src, dst)

        try:
            await env.exec(["true"])  # the first command's code paths, outside the clock
            for _ in range(args.runs):
                times["true"].append(await timed(lambda: env.exec(["true"])))
                times["true-ref"].append(await timed(host_true))
                times["sleeps"].append(await timed(at_once))
                times["sleeps-ref"].append(await timed(in_turn))
                times["put"].append(await timed(put))
                times["put-ref"].append(await timed(host_copy))
                times["get"].append(await timed(get))
                times["get-ref"].append(await timed(host_copy))
        finally:
            report = await env.aclose()
    assert report.confirmed_absent, report
    table = Table(("n", "p50", "p95", "min"), name_width=34)
    lines = [
        f"bench/mux.py: {platform.node()}, {os.cpu_count()} cores, load {load_at_start:.1f} -> "
        f"{os.getloadavg()[0]:.1f}, {args.runs} runs, interleaved; qemu "
        f"{env.info.accelerator}, agent {env.hello.get('agent_version')}",
        "",
        table.header("row (ms)"),
    ]
    for key, name, ref in ROWS:
        lines += [table.row(name, times[key]), table.row(f"  ref: {ref}", times[key + "-ref"])]
    lines += ["", "row / reference, p50 of the same run:"]
    lines += [table.ratio_row(name, times[key], times[key + "-ref"]) for key, name, _ in ROWS]
    for key in ("put", "get"):
        lines.append(f"  64 MiB {key}: {64 / p50(times[key]):.0f} MiB/s (p50)")
    write(args.out, lines)


if __name__ == "__main__":
    asyncio.run(main())
