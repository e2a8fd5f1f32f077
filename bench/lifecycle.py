"""Lifecycle benchmark: per-phase latency of trivial episodes, and the controller's overhead.

Runs N trivial episodes of the tiny test baseline two ways in one process, alternating so that
machine noise hits both alike:
  direct      driver.create -> env.run_episode -> env.aclose (no ledger, no store)
  controller  the full path: ledger intent, create, run, export, record, destroy, confirm
and prints p50/p95 of: create -> agent ready, run, export, destroy + confirm, and the
controller's overhead as a ratio to the direct path. Results: bench/results/lifecycle.txt.

    python bench/lifecycle.py [--episodes 20] [--driver qemu]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stats import Table, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.drivers import get_driver
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.evidence.manifest import Manifest
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"


def manifest(i: int) -> Manifest:
    return Manifest.model_validate(
        {
            "episode_id": f"bench-{i:03d}",
            "seed": i,
            "policy": {"id": "bench"},
            "task": {"mode": "ok"},
        }
    )


async def direct_once(driver_name: str, baseline, i: int, staging: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    driver = get_driver(driver_name)
    limits = manifest(i).limits.merged_over(baseline.limits)
    t0 = time.perf_counter()
    env = await driver.create(
        EnvRequest(new_env_id(), baseline, limits, Owner("bench"), hard_deadline_s=300)
    )
    t1 = time.perf_counter()
    await env.run_episode(
        {
            "manifest": manifest(i).guest_view(),
            "entrypoint": list(baseline.entrypoint),
            "timeout_s": 60,
        },
        staging / str(i),
        quota_bytes=1 << 26,
    )
    t2 = time.perf_counter()
    report = await env.aclose()
    t3 = time.perf_counter()
    assert report.confirmed_absent
    return {"ready": t1 - t0, "run": t2 - t1, "destroy": t3 - t2, "total": t3 - t0}


async def controller_once(ctl: Controller, baseline, i: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    result = await ctl.run([manifest(i)], baseline, run_id=f"bench-{os.getpid()}-{i}")
    total = time.perf_counter() - t0
    episode = result.episodes[0]
    assert episode.outcome.value == "completed", episode.error
    assert episode.destroy is not None and episode.destroy.confirmed_absent
    timings = (episode.record or {})["timings"]
    return {
        "ready": timings["provision_s"],
        "run": timings["run_s"],
        "export": timings["export_s"],
        "destroy": episode.destroy.elapsed_ms / 1000,
        "total": total,
    }


TABLE = Table(("p50", "p95", "min", "max"), name_width=28)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--driver", default="qemu")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lifecycle.txt")
    args = parser.parse_args()
    baseline = resolve_or_build(str(TINY), progress=lambda s, d: print(f"build {s}: {d}"))
    direct: list[dict[str, float]] = []
    via: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, Ledger(Path(tmp) / "ledger.db") as ledger:
        ctl = Controller(
            get_driver(args.driver),
            ledger,
            LocalStore(Path(tmp) / "store"),
            options=RunOptions(parallel=1),
        )
        for i in range(args.episodes):
            direct.append(await direct_once(args.driver, baseline, i, Path(tmp) / "staging"))
            via.append(await controller_once(ctl, baseline, i))
            print(
                f"episode {i + 1}/{args.episodes}: direct {direct[-1]['total']:.2f}s, "
                f"controller {via[-1]['total']:.2f}s",
                file=sys.stderr,
            )
    lines = [
        f"# bench/lifecycle.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores, driver {args.driver}, "
        f"accelerator {ctl.driver.describe().get('accelerator', '?')}, "
        f"{args.episodes} trivial episodes, parallel 1, direct and controller alternating, "
        f"load average at the end {os.getloadavg()[0]:.1f}",
        TABLE.header("phase (ms)"),
        TABLE.row("create -> agent ready", [v["ready"] for v in via]),
        TABLE.row("run (entrypoint+collect)", [v["run"] for v in via]),
        TABLE.row("export (store, record)", [v["export"] for v in via]),
        TABLE.row("destroy + confirm", [v["destroy"] for v in via]),
        TABLE.row("episode total (controller)", [v["total"] for v in via]),
        TABLE.row("episode total (direct)", [v["total"] for v in direct]),
        TABLE.row("destroy + confirm (direct)", [v["destroy"] for v in direct]),
    ]
    ratio = statistics.median(v["total"] for v in via) / statistics.median(
        v["total"] for v in direct
    )
    overhead_ms = (
        statistics.median(v["total"] for v in via) - statistics.median(v["total"] for v in direct)
    ) * 1000
    lines.append(f"controller / direct (median total): {ratio:.3f}x ({overhead_ms:+.0f} ms)")
    write(args.out, lines)


if __name__ == "__main__":
    asyncio.run(main())
