"""Spares against none: trivial episodes/s end to end, and the CPU each episode costs the host.

For each trivial test baseline (warm: a function entrypoint; shell: /bin/sh writes result.json;
tiny: ``python3 entry.py``), batches of --episodes at --parallel, with --spares-each spares and
with none, alternating for --rounds rounds (after one warm-up batch of each): episodes/s first
start -> last finish, the host's busy CPU time per episode (``/proc/stat``: user, nice, system,
irq, softirq of every core, so the other processes on the machine count too) and the
controller's own (``getrusage``). Then, for the function baseline, the QEMU CPU of one
episode's whole VM (--clones each, alternating): a fresh clone's start + RUN -> DONE against a
spare's start + run ahead (WARM_UP) + take + RUN -> DONE; and, as a reference for what
translating guest code costs under TCG, the same episode run a 2nd and a 3rd time in the fresh
clone (its code already translated). Results: bench/results/spares.txt.

    python bench/spares.py [--episodes 24] [--rounds 2] [--parallel 2] [--clones 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import start
from start_profile import qemu_cpu_ms
from stats import RESULTS, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qemu import QemuDriver

BASELINES = {"function": start.WARM, "shell command": start.SHELL, "python3 command": start.TINY}
AGAIN = ("same clone, 2nd", "same clone, 3rd")  # vm_cpu's reference rows


def busy_ticks() -> int:
    """Busy CPU time of the whole host so far, in clock ticks."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return user + nice + system + irq + softirq


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def batch(baseline: Baseline, n: int, parallel: int, spares: int) -> dict[str, float]:
    """One batch: episodes/s, and host and controller CPU ms per episode."""
    ticks, own = busy_ticks(), own_cpu_s()
    rate = await start.episodes_per_s(baseline, n, parallel, "snapshot", spares=spares)
    host_ms = (busy_ticks() - ticks) * 1000 / os.sysconf("SC_CLK_TCK") / n
    return {**rate, "host_ms": host_ms, "controller_ms": (own_cpu_s() - own) * 1000 / n}


async def vm_cpu(baseline: Baseline, clones: int) -> dict[str, list[tuple[float, float]]]:
    """(QEMU CPU ms before RUN, RUN -> DONE) of one function episode's VM: fresh and spare; and,
    as a reference, the fresh clone's RUN -> DONE again (AGAIN: a new child forked, then
    everything translated already), which a VM never does in a batch (one episode a VM)."""
    fresh, spare = QemuDriver(start="snapshot"), QemuDriver(start="snapshot")
    spare.keep_spares(1)
    await (await fresh.create(start.request(baseline))).aclose()
    await (await spare.create(start.request(baseline, spare))).aclose()
    assert baseline.function is not None
    run = {
        "manifest": start.manifest(0).guest_view(),
        "function": baseline.function.to_json(),
        "timeout_s": 60,
        "env": {},
    }
    found: dict[str, list[tuple[float, float]]] = {"fresh clone": [], "spare": []}
    found.update({name: [] for name in AGAIN})
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(clones):
            for kind, driver in (("fresh clone", fresh), ("spare", spare)):
                if kind == "spare":
                    await spare.spares.settled()
                env = await driver.create(
                    start.request(baseline, driver if kind == "spare" else None)
                )
                assert (env.info.spare_s is not None) == (kind == "spare"), env.info
                runs = [kind, *AGAIN] if kind == "fresh clone" else [kind]
                for i, name in enumerate(runs):
                    before = qemu_cpu_ms(env.env_id)
                    out = Path(tmp) / f"{env.env_id}-{i}"
                    await env.run_episode(run, out, quota_bytes=1 << 24)
                    found[name].append((before, qemu_cpu_ms(env.env_id) - before))
                assert (await env.aclose()).confirmed_absent
    await spare.release_spares()
    return found


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--spares-each", type=int, default=None, help="default: --parallel")
    parser.add_argument("--clones", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS / "spares.txt")
    args = parser.parse_args()
    spares_each = args.parallel if args.spares_each is None else args.spares_each
    load_at_start = os.getloadavg()[0]
    baselines = {kind: resolve_or_build(str(spec)) for kind, spec in BASELINES.items()}
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    for kind, baseline in baselines.items():
        for spares in (spares_each, 0):  # a warm-up batch of each: templates, the first spares
            await batch(baseline, 4, args.parallel, spares)
        for _ in range(args.rounds):
            for spares in (spares_each, 0):
                found = await batch(baseline, args.episodes, args.parallel, spares)
                rows.setdefault((kind, spares), []).append(found)
    vms = await vm_cpu(baselines["function"], args.clones)

    def median(values: list[dict[str, float]], key: str) -> float:
        return statistics.median(v[key] for v in values)

    lines = [
        f"# bench/spares.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores, load average (1 min) at the start {load_at_start:.1f}, at the "
        f"end {os.getloadavg()[0]:.1f}",
        f"# {args.rounds} rounds x {args.episodes} trivial episodes per row at --parallel "
        f"{args.parallel}, with {spares_each} spares and with none alternating (medians of the "
        "rounds); host CPU: every core's busy time over the batch, per episode",
        "",
        f"{'baseline':<18} {'spares':>6} {'episodes/s':>11} {'host CPU ms':>12} "
        f"{'controller ms':>14} {'provision ms':>13} {'run ms':>8}",
    ]
    for (kind, spares), values in rows.items():
        lines.append(
            f"{kind:<18} {spares:>6} {median(values, 'episodes'):>11.2f} "
            f"{median(values, 'host_ms'):>12.0f} {median(values, 'controller_ms'):>14.0f} "
            f"{median(values, 'provision_s') * 1000:>13.0f} {median(values, 'run_s') * 1000:>8.0f}"
        )
    lines += [
        "",
        f"QEMU CPU of one function episode's VM ({args.clones} each, alternating; ms p50):",
    ]
    for kind, pairs in vms.items():
        run = statistics.median(r for _, r in pairs)
        if kind in AGAIN:
            lines.append(f"  {kind:<15} {'':>29}RUN -> DONE {run:6.0f}")
            continue
        before = statistics.median(b for b, _ in pairs)
        total = statistics.median(b + r for b, r in pairs)
        what = "start, run ahead, take" if kind == "spare" else "start"
        lines.append(
            f"  {kind:<12} {what}: {before:6.0f}   RUN -> DONE {run:6.0f}   total {total:6.0f}"
        )
    lines.append(
        "  (same clone: the fresh clone's episode run again in it, a reference only: the 2nd "
        "forks a new child, the 3rd finds all its code translated)"
    )
    write(args.out, lines)


if __name__ == "__main__":
    asyncio.run(main())
