"""Hostile-guest benchmark (issue 15 §8): what a guest flooding its serial console costs.

1. Controller CPU per flooding guest: K envs of the tiny baseline each run
   ``yes … > /dev/console`` in the background; over a window we measure this process's own CPU
   time (its threads only: the QEMU processes are children, not counted) and the console bytes
   the driver read, once the flood has spent its burst. Once with the console read at its
   capped rate (``hostproc.CONSOLE_RATE``), once with no rate cap (still read at each tick,
   whatever the pipe holds) as the reference.
2. An innocent env next to 2 hostile ones: wall time of create -> a small Python job -> destroy,
   alone and with the flooders running (medians of R rounds).

    python bench/hostile.py [--window 10] [--rounds 5]
Results: bench/results/hostile.txt. Targets: <= 5% of a core per flooding guest; innocent
within 1.3x of alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

from stats import write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Env, EnvRequest, Owner, new_env_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.host import hostproc

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
FLOOD = "(yes 'flooding the console' > /dev/console) </dev/null >/dev/null 2>&1 &"
WARMUP_S = 5.0  # a flooder spends its console burst (256 KiB at ~100 KiB/s here) before we measure
INNOCENT = ["python3", "-c", "print(sum(i * i for i in range(200000)))"]


def request(baseline: Baseline) -> EnvRequest:
    limits = baseline.limits.merged_over(baseline.limits)
    return EnvRequest(new_env_id(), baseline, limits, Owner("bench-hostile"), 600.0)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def flooders(driver: QemuDriver, baseline: Baseline, k: int) -> list[Env]:
    envs = [await driver.create(request(baseline)) for _ in range(k)]
    for env in envs:
        (await env.exec(["sh", "-c", FLOOD])).check()
    return envs


def console_bytes(driver: QemuDriver, envs: list[Env]) -> int:
    return sum(driver._live[e.env_id].console_bytes for e in envs)


async def controller_cpu(baseline: Baseline, k: int, window_s: float) -> tuple[float, float]:
    """(controller CPU per flooding guest as a share of a core, console MiB/s per guest)."""
    driver = QemuDriver()
    envs = await flooders(driver, baseline, k)
    try:
        await asyncio.sleep(WARMUP_S)  # the flood under way, its burst spent
        cpu0, bytes0, t0 = cpu_s(), console_bytes(driver, envs), time.monotonic()
        await asyncio.sleep(window_s)
        cpu1, bytes1, t1 = cpu_s(), console_bytes(driver, envs), time.monotonic()
    finally:
        for env in envs:
            assert (await env.aclose()).confirmed_absent
    wall = t1 - t0
    return (cpu1 - cpu0) / wall / k, (bytes1 - bytes0) / wall / k / 2**20


async def innocent_once(driver: QemuDriver, baseline: Baseline) -> float:
    t0 = time.perf_counter()
    env = await driver.create(request(baseline))
    try:
        (await env.exec(INNOCENT)).check()
    finally:
        assert (await env.aclose()).confirmed_absent
    return time.perf_counter() - t0


async def innocent(baseline: Baseline, rounds: int) -> tuple[float, float]:
    """(median alone, median next to 2 flooders): alone rounds before and after the hostile
    ones, so that a change in the shared machine's load shows on both sides."""
    driver = QemuDriver()
    await innocent_once(driver, baseline)  # the template, warm caches
    alone = [await innocent_once(driver, baseline) for _ in range(rounds)]
    envs = await flooders(driver, baseline, 2)
    try:
        await asyncio.sleep(WARMUP_S)
        hostile = [await innocent_once(driver, baseline) for _ in range(rounds)]
    finally:
        for env in envs:
            assert (await env.aclose()).confirmed_absent
    alone += [await innocent_once(driver, baseline) for _ in range(rounds)]
    return statistics.median(alone), statistics.median(hostile)


async def run(args: argparse.Namespace, baseline: Baseline) -> list[str]:
    capped_cpu, capped_rate = await controller_cpu(baseline, args.flooders, args.window)
    rate = hostproc.CONSOLE_RATE
    hostproc.CONSOLE_RATE = 1e15  # the reference: read as fast as the guest writes
    try:
        free_cpu, free_rate = await controller_cpu(baseline, args.flooders, args.window)
        alone_free, hostile_free = await innocent(baseline, args.rounds)
    finally:
        hostproc.CONSOLE_RATE = rate
    alone, hostile = await innocent(baseline, args.rounds)
    print("done", file=sys.stderr)
    return [
        f"# bench/hostile.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores shared, qemu microVM (TCG), tiny baseline, load average "
        f"(1 min) at the end {os.getloadavg()[0]:.1f}",
        f"console read at most {rate / 1024:.0f} KiB/s per env after a "
        f"{hostproc.CONSOLE_BURST // 1024} KiB burst, into a "
        f"{hostproc.CONSOLE_TAIL_BYTES // 1024} KiB ring",
        f"controller CPU per flooding guest ({args.flooders} flooding, {args.window:.0f} s):",
        f"  capped     {capped_cpu * 100:5.1f}% of a core   console {capped_rate:7.2f} MiB/s",
        f"  uncapped   {free_cpu * 100:5.1f}% of a core   console {free_rate:7.2f} MiB/s"
        "   (reference: no rate cap)",
        f"innocent env (create, python job, destroy; medians of {args.rounds} next to the "
        f"flooders, {2 * args.rounds} alone: before and after them):",
        f"  capped     alone {alone * 1000:6.0f} ms   next to 2 flooders {hostile * 1000:6.0f} ms"
        f"   {hostile / alone:.2f}x",
        f"  uncapped   alone {alone_free * 1000:6.0f} ms   next to 2 flooders "
        f"{hostile_free * 1000:6.0f} ms   {hostile_free / alone_free:.2f}x",
        "targets: <= 5% of a core per flooding guest; innocent next to 2 hostile <= 1.3x alone",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flooders", type=int, default=2)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hostile.txt")
    args = parser.parse_args()
    baseline = resolve_or_build(str(TINY))
    write(args.out, asyncio.run(run(args, baseline)))


if __name__ == "__main__":
    main()
