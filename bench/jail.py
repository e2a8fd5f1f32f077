"""Jail benchmark (issue 15 §7): what the jailed QEMU costs a start, against no jail, in one run.

On the tiny test baseline, with snapshot clones (the template built first), alternating a
jailed env and an unjailed one (``CLEANROOM_JAIL_UIDS=off``) so the shared machine's load hits
both alike:
  clone -> agent ready            (create)
  clone -> first exec (`true`)    (create + one exec)
  destroy + confirm absent
and the same for cold boots (--cold). Every jailed time is also given as a ratio to the
unjailed one's p50 measured in the same run. Results: bench/results/jail.txt.

    python bench/jail.py [--runs 20] [--cold 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from pathlib import Path

from stats import Table, p50_p95, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.host import jail

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
OUT = ROOT / "bench" / "results" / "jail.txt"


def request(baseline: Baseline) -> EnvRequest:
    limits = baseline.limits.merged_over(baseline.limits)
    return EnvRequest(new_env_id(), baseline, limits, Owner("bench-jail"), 600.0)


async def one(driver: QemuDriver, baseline: Baseline, jailed: bool) -> tuple[float, ...]:
    """(ready, first exec, destroy) of one env, jailed or not."""
    if jailed:
        os.environ.pop(jail.SWITCH_ENV, None)
    else:
        os.environ[jail.SWITCH_ENV] = "off"
    t0 = time.perf_counter()
    env = await driver.create(request(baseline))
    t1 = time.perf_counter()
    (await env.exec(["true"])).check()
    t2 = time.perf_counter()
    assert (env.info.jail or {}).get("uid") is not None if jailed else True
    report = await env.aclose()
    t3 = time.perf_counter()
    assert report.confirmed_absent
    return t1 - t0, t2 - t0, t3 - t2


Runs = dict[bool, list[tuple[float, ...]]]  # jailed? -> (ready, first exec, destroy) per env


async def series(driver: QemuDriver, baseline: Baseline, n: int) -> Runs:
    await one(driver, baseline, True)  # the template, warm caches
    out: Runs = {True: [], False: []}
    for i in range(n):
        for jailed in (True, False) if i % 2 == 0 else (False, True):
            out[jailed].append(await one(driver, baseline, jailed))
    return out


def rows(title: str, got: Runs) -> list[str]:
    table = Table(("n", "p50", "p95"), 34)
    lines = [table.header(title) + "   jailed p50 / unjailed p50"]
    for i, step in enumerate(("-> agent ready", "-> first exec `true`", "destroy + confirm")):
        ref = p50_p95([r[i] for r in got[False]])[0]
        new = p50_p95([r[i] for r in got[True]])[0]
        lines.append(table.row(f"unjailed {step}", [r[i] for r in got[False]]))
        lines.append(
            table.row(f"jailed   {step}", [r[i] for r in got[True]]) + f"   {new / ref:.2f}"
        )
    return lines


async def main(args: argparse.Namespace) -> None:
    if jail.unavailable() is not None:
        sys.exit(f"no jail here: {jail.unavailable()}")
    baseline = resolve_or_build(str(TINY))
    clones = await series(QemuDriver(start="snapshot"), baseline, args.runs)
    cold = await series(QemuDriver(start="cold"), baseline, args.cold) if args.cold else None
    lines = [
        f"# bench/jail.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"load {os.getloadavg()[0]:.1f}; times in ms; jailed and unjailed envs alternate",
        *rows("snapshot clone", clones),
    ]
    if cold is not None:
        lines += ["", *rows("cold boot (TCG)", cold)]
    write(OUT, lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--cold", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
