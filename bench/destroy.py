"""Destroy benchmark: destroy + confirm latency over N live envs, and the deadman time.

1. Boots N envs of the tiny baseline (a few at a time), then destroys them one by one; each
   destroy is SIGKILL -> reap -> remove the run folder -> confirm absent (no process with the
   env's marker, no run folder). p50/p99 of that, next to the cost of one bare /proc marker
   scan (what the confirmation costs) as the reference measured in the same run.
2. Deadman: a child controller process boots K envs and is SIGKILLed; we time from the kill to
   the moment no process of those envs is left (parent-death signals, no reaper involved).

    python bench/destroy.py [--envs 50] [--deadman-envs 4]
Results: bench/results/destroy.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from stats import Table, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Env, EnvRequest, Owner, new_env_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.host import hostproc
from cleanroom.observe.report import percentile

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
HARD_DEADLINE_S = 600.0


async def boot(driver: QemuDriver, baseline: Baseline, n: int, at_once: int) -> list[Env]:
    envs: list[Env] = []
    gate = asyncio.Semaphore(at_once)
    limits = baseline.limits.merged_over(baseline.limits)

    async def one() -> None:
        async with gate:
            request = EnvRequest(new_env_id(), baseline, limits, Owner("bench"), HARD_DEADLINE_S)
            envs.append(await driver.create(request))
            print(f"booted {len(envs)}/{n}", file=sys.stderr)

    async with asyncio.TaskGroup() as group:
        for _ in range(n):
            group.create_task(one())
    return envs


async def destroy_latencies(
    baseline: Baseline, n: int, at_once: int
) -> tuple[list[float], list[float]]:
    driver = QemuDriver()
    envs = await boot(driver, baseline, n, at_once)
    scans: list[float] = []
    destroys: list[float] = []
    for env in envs:
        t0 = time.perf_counter()
        hostproc.pids_with_marker(env.env_id)  # reference: the /proc scan that confirms absence
        scans.append(time.perf_counter() - t0)
        report = await env.aclose()
        assert report.confirmed_absent, report
        destroys.append(report.elapsed_ms / 1000)
    return destroys, scans


CHILD = """
import asyncio, json, sys
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.drivers.qemu import QemuDriver

async def main():
    baseline = resolve_or_build(sys.argv[1])
    driver = QemuDriver()
    limits = baseline.limits.merged_over(baseline.limits)
    envs = [await driver.create(EnvRequest(new_env_id(), baseline, limits, Owner("deadman"), 600))
            for _ in range(int(sys.argv[2]))]
    print(json.dumps([e.env_id for e in envs]), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def deadman(k: int) -> float:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(TINY), str(k)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    env_ids = json.loads(child.stdout.readline())
    assert all(hostproc.pids_with_marker(e) for e in env_ids)
    t0 = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    while any(hostproc.pids_with_marker(e) for e in env_ids):
        if time.perf_counter() - t0 > 30:
            raise AssertionError("VMs outlived their controller by 30 s")
        time.sleep(0.001)
    elapsed = time.perf_counter() - t0
    driver = QemuDriver()
    for env_id in env_ids:  # the run folders stay for `cleanroom reap`; tidy them here
        asyncio.run(driver.destroy(env_id))
    return elapsed


TABLE = Table(("p50", "p99", "min", "max"), name_width=34, width=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=50)
    parser.add_argument("--at-once", type=int, default=4)
    parser.add_argument("--deadman-envs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "destroy.txt")
    args = parser.parse_args()
    baseline = resolve_or_build(str(TINY))
    destroys, scans = asyncio.run(destroy_latencies(baseline, args.envs, args.at_once))
    killed = [deadman(args.deadman_envs) for _ in range(3)]
    lines = [
        f"# bench/destroy.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores, qemu microVM (TCG), tiny baseline, "
        f"load average (1 min) at the end {os.getloadavg()[0]:.1f}",
        TABLE.header("(ms)"),
        TABLE.row(f"destroy + confirm ({args.envs} envs)", destroys),
        TABLE.row("reference: one /proc marker scan", scans),
        TABLE.row(f"deadman: SIGKILL ctl -> {args.deadman_envs} VMs gone", killed),
        f"destroy+confirm p50 / marker-scan p50: "
        f"{percentile(destroys, 50) / percentile(scans, 50):.1f}x",
        f"deadman worst {max(killed) * 1000:.0f} ms vs the VM deadline ({HARD_DEADLINE_S:.0f} s): "
        "parent-death signals, not the deadline, end them",
        "targets: destroy+confirm <= 20 ms p50, <= 100 ms p99; deadman <= VM deadline + 1 s",
    ]
    write(args.out, lines)


if __name__ == "__main__":
    main()
