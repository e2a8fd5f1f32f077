"""Two builds of one baseline (say the native agent before and after a change), same run.

A session is opened on each (qemu, snapshot starts, from a spare) and held open; then, round
after round and alternating between them so the machine's noise hits both alike:
  repeated command        (``true``; 8 a round)
    of it, in the guest   (the agent's own ``duration_s``: spawn -> exit -> output drained)
  guest spawn floor       (bench/spawn_floor.c in the same VM: the kernel's spawn and the
                           loader of /bin/true with no agent and no channel, per spawn)
  1 MiB write, 1 MiB read (``files.write`` / ``files.read``, each its own row)
  64 MiB write, read      (MB/s, --big rounds at the end)
Each "after" row is also given as a ratio to the "before" row of the same run.
Results: bench/results/agent_ab.txt (``--out``). Run it under ``nice`` on a shared machine.

    python bench/agent_ab.py --before sha256:... [--after SPEC_OR_DIGEST] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from session import MIB, TINY, build_floor
from stats import Table, p50_p95, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import AsyncSession, session
from cleanroom.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent
NATIVE = TINY  # the tiny baseline runs the native agent (the default kind)
ROWS = (
    ("true", "repeated command (`true`)"),
    ("agent", "  of it, in the guest (duration_s)"),
    ("floor", "guest spawn floor (/bin/true)"),
    ("put", "1 MiB write"),
    ("get", "1 MiB read"),
)


class Side:
    """One build's open session and its timings."""

    def __init__(self, name: str, sb: AsyncSession) -> None:
        self.name, self.sb = name, sb
        self.times: dict[str, list[float]] = {}

    def add(self, key: str, value: float) -> None:
        self.times.setdefault(key, []).append(value)

    async def round(self, data: bytes) -> None:
        for _ in range(8):
            t = time.perf_counter()
            result = (await self.sb.commands.run(["true"])).check()
            self.add("true", time.perf_counter() - t)
            self.add("agent", result.duration_s)
        loop = (await self.sb.exec(["/tmp/spawn_floor", "10", "/bin/true"])).check()
        self.add("floor", float(loop.stdout) / 1e6)
        t = time.perf_counter()
        await self.sb.files.write("/tmp/one.bin", data)
        self.add("put", time.perf_counter() - t)
        t = time.perf_counter()
        assert await self.sb.files.read("/tmp/one.bin") == data
        self.add("get", time.perf_counter() - t)

    async def big(self, blob: bytes) -> None:
        t = time.perf_counter()
        await self.sb.files.write("/tmp/big.bin", blob)
        self.add("put MB/s", len(blob) / 1e6 / (time.perf_counter() - t))
        t = time.perf_counter()
        assert await self.sb.files.read("/tmp/big.bin") == blob
        self.add("get MB/s", len(blob) / 1e6 / (time.perf_counter() - t))
        (await self.sb.exec(["rm", "-f", "/tmp/big.bin"])).check()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a baseline digest or spec")
    parser.add_argument("--after", default=str(NATIVE), help="a baseline digest or spec")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--big", type=int, default=2, help="rounds of 64 MiB each way")
    parser.add_argument("--note", default="", help="what the two builds are (the header)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "agent_ab.txt")
    args = parser.parse_args()
    refs = {"before": args.before, "after": args.after}
    baselines = {
        k: resolve_or_build(v, progress=lambda s, d: print(f"build {s}: {d}"))
        for k, v in refs.items()
    }
    load_at_start = os.getloadavg()[0]
    drivers: list[QemuDriver] = []
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as name:
        tmp = Path(name)
        floor = build_floor(tmp)
        ledger = Ledger(tmp / "ledger.db")
        sides: list[Side] = []
        try:
            async with contextlib.AsyncExitStack() as stack:
                for k, baseline in baselines.items():
                    driver = QemuDriver(start="snapshot")
                    driver.keep_spares(1)
                    drivers.append(driver)
                    sb: Any = await stack.enter_async_context(
                        session(
                            baseline,
                            driver=driver,
                            ledger=ledger,
                            store=LocalStore(tmp / f"store-{k}"),
                            run_id=f"ab-{k}",
                            options=RunOptions(staging_dir=tmp / f"staging-{k}", spares=1),
                            timeout_s=1800,
                        )
                    )
                    await sb.files.write("/tmp/spawn_floor", floor, mode=0o755)
                    (await sb.commands.run(["true"])).check()  # the first command is not timed
                    sides.append(Side(k, sb))
                data = os.urandom(MIB)
                for i in range(args.rounds):
                    for side in sides:
                        await side.round(data)
                    print(f"round {i + 1}/{args.rounds}")
                blob = os.urandom(64 * MIB)
                for _ in range(args.big):
                    for side in sides:
                        await side.big(blob)
                for side in sides:
                    side.sb.finish(reward=0.0)
        finally:
            for driver in drivers:
                await driver.release_spares()
            ledger.close()
    write(args.out, report(sides, baselines, args, load_at_start))


def report(
    sides: list[Side], baselines: dict[str, Any], args: argparse.Namespace, load: float
) -> list[str]:
    before, after = sides
    table = Table(("n", "p50", "p95"), name_width=36, n_width=4)
    lines = [
        f"# bench/agent_ab.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores, TCG; load average (1 min) at the start {load:.1f}, at the end "
        f"{os.getloadavg()[0]:.1f}; {args.rounds} rounds, interleaved; {args.note}",
        f"# before: {args.before} = {baselines['before'].digest}",
        f"# after:  {args.after} = {baselines['after'].digest}",
        "",
    ]
    for side in sides:
        lines.append(f"{table.header(side.name + ' (ms)')}")
        lines += [table.row(label, side.times[key]) for key, label in ROWS]
        for key in ("put MB/s", "get MB/s"):
            if side.times.get(key):
                rate = statistics.median(side.times[key])
                lines.append(f"64 MiB {key:<29} {len(side.times[key]):>4} {rate:>9.0f}")
        lines.append("")
    lines.append("after / before, p50 of the same run (< 1: faster; MB/s rows: > 1 faster):")
    for key, label in ROWS:
        ratio = p50_p95(after.times[key])[0] / p50_p95(before.times[key])[0]
        lines.append(f"  {label:<36} {ratio:.2f}")
    for key in ("put MB/s", "get MB/s"):
        if before.times.get(key):
            ratio = statistics.median(after.times[key]) / statistics.median(before.times[key])
            lines.append(f"  64 MiB {key:<29} {ratio:.2f}")
    floor = p50_p95(after.times["true"])[0] / p50_p95(after.times["floor"])[0]
    lines.append(f"  after: repeated command / guest spawn floor: {floor:.2f}")
    return lines


if __name__ == "__main__":
    asyncio.run(main())
