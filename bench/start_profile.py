"""Where a start's time goes: per-step timestamps of clone and cold starts (tiny baseline).

Wraps the qemu driver's steps (spawn, monitor answers, agent channel, HELLO; QMP commands of
older trees) with ``time.perf_counter`` marks, without changing the driver, and prints the
median time of each step since the previous one. Clone and cold runs alternate. The guest's
own facts come from its HELLO (``reseed_ms``; ``boot_time_s`` = guest uptime at HELLO).

``--ab SRC`` compares two source trees in one command: rounds of this script run under
``PYTHONPATH=SRC`` ("ref") and under this tree ("new") alternate, so load hits both alike.

    python bench/start_profile.py [--clones 20] [--cold 3] [--burst 8] [--bursts 3]
    python bench/start_profile.py --ab /tmp/ref/src --rounds 4 [--clones 5 ...]
    python bench/start_profile.py --floor 5   # the cold boot before any agent: power off at /init
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ab

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
STEPS = {  # (module, owner, attribute) -> label; missing ones (older trees) are skipped
    ("cleanroom.drivers.qemu.templates", "Templates", "template_for"): "template checked",
    ("cleanroom.drivers.qemu.launch", "Launcher", "spawn"): "QEMU spawned",
    ("cleanroom.drivers.qmp", None, "read_answers"): "monitor answered the load",
    ("cleanroom.drivers.qmp", "QmpClient", "connect"): "QMP connected",
    ("cleanroom.drivers.qmp", "QmpClient", "execute"): "QMP {1}",
    ("cleanroom.drivers.qmp", "QmpClient", "wait_event"): "QMP event {1}",
    ("cleanroom.drivers.qemu.live", "Live", "open_channel"): "agent channel open",
    ("cleanroom.agent.connection", "AgentConnection", "wait_hello"): "HELLO received",
}
_marks: list[tuple[str, float]] = []


def instrument() -> None:
    import importlib

    for (module, owner_name, attr), label in STEPS.items():
        mod = importlib.import_module(module)
        owner = getattr(mod, owner_name) if owner_name else mod
        original = getattr(owner, attr, None)
        if original is not None:
            setattr(owner, attr, _marked(original, label))


def _marked(original: Any, label: str) -> Any:
    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        _marks.append((label.format(*args), time.perf_counter()))
        return result

    return wrapper


async def one(driver: Any, baseline: Any, request: Any) -> dict[str, Any]:
    """One create -> ready: (step, ms since the previous step) pairs, and the HELLO."""
    _marks.clear()
    t0 = time.perf_counter()
    env = await driver.create(request(baseline))
    _marks.append(("create returned", time.perf_counter()))
    cpu_ms = qemu_cpu_ms(env.env_id)
    steps, last = [], t0
    for name, when in _marks:
        steps.append((name, (when - last) * 1000))
        last = when
    hello = dict(env.session.hello)
    await env.aclose()
    return {"steps": steps, "total": (last - t0) * 1000, "hello": hello, "cpu_ms": cpu_ms}


def qemu_cpu_ms(env_id: str) -> float:
    """CPU time the env's QEMU process used so far (all threads; less load-sensitive)."""
    from cleanroom.host import hostproc

    total = 0
    for pid in hostproc.pids_with_marker(env_id):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("qemu-system"):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue
    return total / 1e6


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.core.limits import Limits
    from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
    from cleanroom.drivers.qemu import QemuDriver

    def request(baseline: Any) -> EnvRequest:
        limits = Limits().merged_over(baseline.limits)
        return EnvRequest(new_env_id(), baseline, limits, Owner("bench-profile"), 600)

    instrument()
    baseline = resolve_or_build(str(TINY))
    cold, snap = QemuDriver(start="cold"), QemuDriver(start="snapshot")
    await (await snap.create(request(baseline))).aclose()  # the template, built if needed
    clones: list[dict[str, Any]] = []
    colds: list[dict[str, Any]] = []
    every = max(args.clones // max(args.cold, 1), 1)
    for i in range(args.clones):
        clones.append(await one(snap, baseline, request))
        if i % every == 0 and len(colds) < args.cold:
            colds.append(await one(cold, baseline, request))
    bursts = []
    for _ in range(args.bursts):
        t0 = time.perf_counter()
        envs = await asyncio.gather(*(snap.create(request(baseline)) for _ in range(args.burst)))
        bursts.append((time.perf_counter() - t0) * 1000)
        await asyncio.gather(*(env.aclose() for env in envs))
    return {"clone": clones, "cold": colds, "bursts": bursts}


def table(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median ms per step (a step's n-th occurrence in a run is its own row)."""
    per_step: dict[str, list[float]] = {}
    for run in runs:
        seen: dict[str, int] = {}
        for name, ms in run["steps"]:
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name} #{seen[name]}"
            per_step.setdefault(key, []).append(ms)
    rows = {key: statistics.median(values) for key, values in per_step.items()}
    rows["total (create -> ready)"] = statistics.median(r["total"] for r in runs)
    return rows


def report(results: dict[str, dict[str, Any]], burst: int) -> list[str]:
    """Side-by-side medians per step for each labelled result ("ref", "new")."""
    labels = list(results)
    lines = []
    for kind in ("clone", "cold"):
        tables = {lab: table(res[kind]) for lab, res in results.items() if res[kind]}
        if not tables:
            continue
        n = {lab: len(results[lab][kind]) for lab in tables}
        head = "".join(f"{f'{lab} (n={n[lab]})':>16}" for lab in tables)
        lines.append(f"{kind}: median ms per step, since the previous step{'':<8}{head}")
        keys: list[str] = []
        for t in tables.values():  # each table's steps in run order, new ones after their
            for prev, key in zip([None, *t], t, strict=False):  # predecessor
                if key not in keys:
                    keys.insert(keys.index(prev) + 1 if prev in keys else len(keys), key)
        for key in keys:
            cells = "".join(
                f"{tables[lab][key]:>16.1f}" if key in tables[lab] else f"{'-':>16}"
                for lab in tables
            )
            lines.append(f"  {key:<52}{cells}")
        cpu = {lab: [r["cpu_ms"] for r in results[lab][kind] if "cpu_ms" in r] for lab in tables}
        if all(cpu.values()):
            cells = "".join(f"{statistics.median(cpu[lab]):>16.1f}" for lab in tables)
            lines.append(f"  {'QEMU CPU time, create -> ready (ms)':<52}{cells}")
        for fact, scale in (("reseed_ms", 1.0), ("boot_time_s", 1000.0)):
            values = {
                lab: [r["hello"][fact] * scale for r in results[lab][kind] if fact in r["hello"]]
                for lab in tables
            }
            if all(values.values()):
                cells = "".join(f"{statistics.median(values[lab]):>16.1f}" for lab in tables)
                lines.append(f"  {'guest: ' + fact + ' (ms)':<52}{cells}")
    if all(results[lab]["bursts"] for lab in labels):
        cells = "".join(f"{statistics.median(results[lab]['bursts']):>16.0f}" for lab in labels)
        lines.append(f"{burst} clones ready at once, median ms{'':<22}{cells}")
    return lines


def run_ab(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Alternate rounds of this script under the other tree ("ref") and this one ("new")."""
    merged = {lab: {"clone": [], "cold": [], "bursts": []} for lab in ("ref", "new")}
    child = [sys.executable, __file__, "--clones", str(args.clones), "--cold", str(args.cold)]
    child += ["--burst", str(args.burst), "--bursts", str(args.bursts)]
    for lab, part in ab.rounds(child, args.ab, ROOT / "src", args.rounds):
        for key in merged[lab]:
            merged[lab][key] += part[key]
    return merged


def floor(boots: int) -> list[str]:
    """The cold boot's floor: the env's own QEMU command (machine, devices, kernel, initramfs,
    command line) with ``rdinit`` set to power off at once, so no agent, module or mount runs.
    Whatever an agent does comes on top of this."""
    import resource

    from cleanroom.agent import bulk
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.core.limits import Limits
    from cleanroom.drivers import accel as accel_mod
    from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
    from cleanroom.drivers.qemu.cmdline import machine_args

    baseline = resolve_or_build(str(TINY))
    limits = Limits().merged_over(baseline.limits)
    request = EnvRequest(new_env_id(), baseline, limits, Owner("bench-floor"), 600)
    argv = [
        accel_mod.QEMU,
        *machine_args(request, accel_mod.Accel("tcg", "", "floor")),
        *bulk.qemu_args(Path("/dev/null")),  # the device's backend; this floor boot never reads it
        "-chardev",
        "null,id=ctl",
    ]
    at = argv.index("-append") + 1
    argv[at] += " rdinit=/bin/busybox -- poweroff -f"
    lines = []
    for _ in range(boots):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        what = "QEMU start -> guest kernel at /init -> powered off"
        lines.append(f"  {what}: {wall:.2f} s wall, {cpu:.2f} s CPU")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clones", type=int, default=20)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--ab", type=Path, help="another tree's src/ to compare against")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write every run's steps here")
    parser.add_argument(
        "--floor", type=int, default=0, help="only: N boots to an init that powers off"
    )
    args = parser.parse_args()
    load = os.getloadavg()[0]
    if args.floor:
        print("\n".join(floor(args.floor)))
        print(f"load average (1 min) at the start {load:.1f}, at the end {os.getloadavg()[0]:.1f}")
        return
    results = run_ab(args) if args.ab else {"this": asyncio.run(measure(args))}
    if args.json:
        args.json.write_text(json.dumps(results["this"] if not args.ab else results))
        if not args.ab:
            return
    print(f"load average (1 min) at the start {load:.1f}, at the end {os.getloadavg()[0]:.1f}")
    print("\n".join(report(results, args.burst)))


if __name__ == "__main__":
    main()
