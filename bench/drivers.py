"""Driver benchmark: gVisor and QEMU side by side, create -> agent ready and destroy + confirm.

Creates N environments of the tiny test baseline with each driver, alternating (gvisor, qemu,
qemu-cold, gvisor, ...) so that machine noise hits all alike, one at a time. ``qemu`` is the
qemu driver as ``--driver qemu`` runs it (snapshot clones when it can), ``qemu-cold`` the same
driver booting the kernel every time. Per env it measures:
  create -> agent ready   driver.create until the agent's HELLO
  first exec              ``python3 -c pass`` in the fresh env (a cold Python start)
  destroy + confirm       env.aclose(): kill, remove, confirm absent
and prints p50/p95 per driver with gVisor's time as a ratio to each QEMU variant's (p50 and
p95). Results: bench/results/drivers.txt.

    python bench/drivers.py [--envs 10] [--drivers gvisor,qemu,qemu-cold]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from pathlib import Path

from stats import p50_p95, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers import get_driver
from cleanroom.drivers.base import Driver, EnvRequest, Owner, new_env_id
from cleanroom.drivers.qemu import QemuDriver

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
PHASES = ("ready", "exec", "destroy", "total")
LABELS = {
    "ready": "create -> agent ready",
    "exec": "first exec (python3 -c pass)",
    "destroy": "destroy + confirm",
    "total": "env total",
}


def make_driver(name: str) -> Driver:
    return QemuDriver(start="cold") if name == "qemu-cold" else get_driver(name)


async def once(driver: Driver, baseline: Baseline) -> dict[str, float]:
    limits = ResolvedLimits(timeout_s=60, vcpus=1, memory_mib=256)
    t0 = time.perf_counter()
    env = await driver.create(
        EnvRequest(new_env_id(), baseline, limits, Owner("bench"), hard_deadline_s=300)
    )
    t1 = time.perf_counter()
    (await env.exec(["python3", "-c", "pass"])).check()
    t2 = time.perf_counter()
    report = await env.aclose()
    t3 = time.perf_counter()
    if not report.confirmed_absent:
        raise SystemExit(f"{driver.name}: env {env.env_id} not confirmed absent: {report}")
    return {"ready": t1 - t0, "exec": t2 - t1, "destroy": t3 - t2, "total": t3 - t0}


def table(samples: dict[str, list[dict[str, float]]], names: list[str]) -> list[str]:
    refs = [n for n in names if n.startswith("qemu")]
    others = [n for n in names if not n.startswith("qemu")]
    head = f"{'phase (ms)':<30}"
    for name in names:
        head += f" {name + ' p50':>14} {name + ' p95':>14}"
    pairs = [(n, r) for n in others for r in refs]
    head += "".join(f" {n + '/' + r + ' p50':>20} {'p95':>7}" for n, r in pairs)
    lines = [head]
    for phase in PHASES:
        line = f"{LABELS[phase]:<30}"
        stats: dict[str, tuple[float, float]] = {}
        for name in names:
            stats[name] = p50_p95([s[phase] for s in samples[name]])
            line += f" {stats[name][0]:>14.1f} {stats[name][1]:>14.1f}"
        for n, r in pairs:
            p50 = stats[n][0] / stats[r][0] if stats[r][0] else float("nan")
            p95 = stats[n][1] / stats[r][1] if stats[r][1] else float("nan")
            line += f" {p50:>19.3f}x {p95:>6.2f}x"
        lines.append(line)
    return lines


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--envs", type=int, default=10, help="environments per driver")
    parser.add_argument("--drivers", default="gvisor,qemu,qemu-cold")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "drivers.txt")
    args = parser.parse_args()
    names = [n.strip() for n in args.drivers.split(",") if n.strip()]
    baseline = resolve_or_build(str(TINY), progress=lambda s, d: print(f"build {s}: {d}"))
    drivers = {name: make_driver(name) for name in names}
    for driver in drivers.values():  # warm-up: KVM probe, root tree extraction; not measured
        await once(driver, baseline)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for i in range(args.envs):
        for name in names:
            samples[name].append(await once(drivers[name], baseline))
            print(
                f"{i + 1}/{args.envs} {name}: ready {samples[name][-1]['ready']:.3f}s, "
                f"destroy {samples[name][-1]['destroy'] * 1000:.0f}ms",
                file=sys.stderr,
            )
    facts = ", ".join(
        f"{n} = {d.describe().get('accelerator', '?')} ({d.describe().get('isolation', '?')})"
        for n, d in drivers.items()
    )
    lines = [
        f"# bench/drivers.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores; {args.envs} envs per driver, alternating, one at a time; "
        f"tiny baseline {baseline.short}; {facts}",
        *table(samples, names),
    ]
    write(args.out, lines)


if __name__ == "__main__":
    asyncio.run(main())
