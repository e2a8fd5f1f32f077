"""Where a trivial episode's time goes in a fresh snapshot clone: ready, then RUN -> DONE.

For each clone of the warm test baseline (a function entrypoint) and, with ``--command``, of the
tiny one (a command entrypoint): wall time and the QEMU process's CPU time (all threads) from
create to agent ready, and from RUN to DONE (manifest in, output, an artifact, result out).
CPU time is the steadier number on this shared machine: under TCG a clone's cost is mostly
translating the guest code it runs for the first time.

``--ab SRC`` compares two source trees in one command (rounds alternate between
``PYTHONPATH=SRC``, "ref", and this tree, "new"); each tree builds its own baselines, since the
guest agent is part of a baseline.

    python bench/episode_profile.py [--clones 10] [--command]
    python bench/episode_profile.py --ab /tmp/ref/src --rounds 4 --clones 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ab
from start_profile import qemu_cpu_ms

ROOT = Path(__file__).resolve().parent.parent
BASELINES = {
    "function": ROOT / "tests" / "baselines" / "warm" / "baseline.toml",
    "command": ROOT / "tests" / "baselines" / "tiny" / "baseline.toml",
}
PHASES = ("ready_ms", "ready_cpu_ms", "run_ms", "run_cpu_ms")


async def one(driver: Any, baseline: Any, staging: Path) -> dict[str, float]:
    """One fresh clone: create -> ready, then one trivial episode; wall and CPU ms."""
    from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
    from cleanroom.evidence.manifest import Manifest

    manifest = Manifest.model_validate(
        {"episode_id": "profile", "seed": 1, "policy": {"id": "bench"}, "task": {"mode": "ok"}}
    )
    limits = manifest.limits.merged_over(baseline.limits)
    request = EnvRequest(new_env_id(), baseline, limits, Owner("bench-episode"), 600)
    t0 = time.perf_counter()
    env = await driver.create(request)
    t1 = time.perf_counter()
    cpu_ready = qemu_cpu_ms(env.env_id)
    try:
        entry: dict[str, Any] = (
            {"function": baseline.function.to_json()}
            if baseline.function is not None
            else {"entrypoint": list(baseline.entrypoint)}
        )
        run = {"manifest": manifest.guest_view(), **entry, "timeout_s": 60, "env": {}}
        output = await env.run_episode(run, staging / env.env_id, quota_bytes=1 << 24)
        t2 = time.perf_counter()
        cpu_run = qemu_cpu_ms(env.env_id) - cpu_ready
    finally:
        assert (await env.aclose()).confirmed_absent
    assert output.exit.exit_code == 0 and output.result_raw, output.exit
    return {
        "ready_ms": (t1 - t0) * 1000,
        "ready_cpu_ms": cpu_ready,
        "run_ms": (t2 - t1) * 1000,
        "run_cpu_ms": cpu_run,
    }


async def measure(kinds: list[str], clones: int) -> dict[str, list[dict[str, float]]]:
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.drivers.qemu import QemuDriver

    driver = QemuDriver(start="snapshot")
    baselines = {kind: resolve_or_build(str(BASELINES[kind])) for kind in kinds}
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:  # the template, built unless cached; not measured
            await one(driver, baselines[kind], Path(tmp))
        for _ in range(clones):
            for kind in kinds:  # interleaved: noise hits every kind alike
                results[kind].append(await one(driver, baselines[kind], Path(tmp)))
    return results


def run_ab(args: argparse.Namespace, kinds: list[str]) -> dict[str, dict[str, list[Any]]]:
    merged: dict[str, dict[str, list[Any]]] = {
        lab: {k: [] for k in kinds} for lab in ("ref", "new")
    }
    child = [sys.executable, __file__, "--clones", str(args.clones)]
    child += ["--command"] if args.command else []
    for lab, part in ab.rounds(child, args.ab, ROOT / "src", args.rounds):
        for kind in kinds:
            merged[lab][kind] += part[kind]
    return merged


def report(results: dict[str, dict[str, list[dict[str, float]]]]) -> list[str]:
    labels = list(results)
    lines = [f"{'median (ms)':<34}" + "".join(f"{lab:>12}" for lab in labels)]
    for kind in next(iter(results.values())):
        for phase in PHASES:
            cells = []
            for lab in labels:
                runs = results[lab][kind]
                cells.append(f"{statistics.median(r[phase] for r in runs):>12.1f}")
            lines.append(f"{kind + ': ' + phase:<34}" + "".join(cells))
    n = ", ".join(f"{lab} {len(r)}" for lab, runs in results.items() for r in runs.values())
    lines.append(f"clones per kind: {n}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clones", type=int, default=10)
    parser.add_argument("--command", action="store_true", help="also the tiny command baseline")
    parser.add_argument("--ab", type=Path, help="another tree's src/ to compare against")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write the runs here (and print nothing)")
    args = parser.parse_args()
    kinds = ["function", "command"] if args.command else ["function"]
    load = os.getloadavg()[0]
    if args.ab:
        results = run_ab(args, kinds)
    else:
        this = asyncio.run(measure(kinds, args.clones))
        if args.json:
            args.json.write_text(json.dumps(this))
            return
        results = {"this": this}
    print(f"load average (1 min) at the start {load:.1f}, at the end {os.getloadavg()[0]:.1f}")
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()
