"""Start benchmark: cold boots against snapshot clones, side by side in one run.

Measures, on the tiny test baseline (the template is built first, if needed, and timed):
  cold boot -> agent ready                 (--cold runs; a boot takes seconds under TCG)
  clone -> agent ready                     (--runs runs)
  clone -> first exec (`true`) answered    (same clones: create + one exec)
  destroy + confirm of a clone             (same clones)
  spare clone -> agent ready               (--runs runs: a clone started ahead, paused; the
                                            clock starts at create, once it is ready)
  N clones ready at once                   (--bursts bursts of --burst clones; and of N spares)
  PSS per QEMU process with --idle idle clones alive (/proc/PID/smaps_rollup), and one cold VM
  trivial episodes per second end to end   (Controller + LocalStore + Ledger in a temp dir,
                                            task {"mode": "ok"}, --episodes at --parallel 2, 4;
                                            and at 2 with 2 spares; the default
                                            keeps spares only on idle cores)
and, for the warm test baseline (a function entrypoint run by the agent's warm worker):
  clone: function episode answered         (--warm fresh clones: RUN -> DONE of a trivial
                                            function episode), beside a command episode
                                            (tiny: python3; shell: /bin/sh writes
                                            result.json) and `python3 -c pass` in fresh
                                            clones; the same three from spares
  trivial function episodes per second end to end (--episodes at --parallel 2, 4)
Cold and clone runs alternate, so machine noise hits both alike; every time is also given as
a ratio to the cold boot's p50 measured in the same run. Results: bench/results/start.txt;
``--only-warm`` runs just the warm rows (and their command baselines) into
bench/results/warm.txt.

    python bench/start.py [--cold 10] [--runs 30] [--bursts 30] [--episodes 40] [--warm 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from stats import Table, p50_p95, write

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers import snapshot
from cleanroom.drivers.base import Env, EnvRequest, Owner, new_env_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.host import hostproc
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
WARM = ROOT / "tests" / "baselines" / "warm" / "baseline.toml"
SHELL = ROOT / "tests" / "baselines" / "shell" / "baseline.toml"  # /bin/sh writes result.json


def manifest(i: int) -> Manifest:
    return Manifest.model_validate(
        {
            "episode_id": f"start-{i:04d}",
            "seed": i,
            "policy": {"id": "bench"},
            "task": {"mode": "ok"},
        }
    )


def request(baseline: Baseline, driver: QemuDriver | None = None) -> EnvRequest:
    """A request for a new env; with ``driver``, under the id it hands out (a spare's)."""
    limits = manifest(0).limits.merged_over(baseline.limits)
    env_id = driver.next_env_id(baseline, limits) if driver else new_env_id()
    return EnvRequest(env_id, baseline, limits, Owner("bench-start"), hard_deadline_s=600)


async def timed_env(
    driver: QemuDriver, baseline: Baseline, python: bool, spare: bool = False
) -> dict[str, float]:
    """create -> ready, + first `true` (+ then `python3 -c pass`), destroy + confirm (s).
    ``spare``: a spare started ahead (and settled) before the clock starts."""
    if spare:
        await driver.spares.settled()
    t0 = time.perf_counter()
    env = await driver.create(request(baseline, driver if spare else None))
    t1 = time.perf_counter()
    assert spare == (env.info.spare_s is not None), env.info
    (await env.exec(["true"])).check()
    t2 = time.perf_counter()
    times = {"ready": t1 - t0, "exec": t2 - t0}
    reseed_ms = env.hello.get("reseed_ms")  # a clone's RESEED -> HELLO, timed in the guest
    if isinstance(reseed_ms, int | float):
        times["reseed"] = reseed_ms / 1000
    if python:
        (await env.exec(["python3", "-c", "pass"])).check()
        times["python"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    report = await env.aclose()
    times["destroy"] = time.perf_counter() - t3
    assert report.confirmed_absent, report
    return times


async def timed_episode(
    driver: QemuDriver, baseline: Baseline, staging: Path, spare: bool = False
) -> float:
    """A fresh clone runs one trivial episode: seconds from RUN to DONE (agent ready before).
    ``spare``: the clone is a spare (started and run once ahead, then settled)."""
    if spare:
        await driver.spares.settled()
    env = await driver.create(request(baseline, driver if spare else None))
    assert spare == (env.info.spare_s is not None), env.info
    try:
        m = manifest(0)
        entry: dict[str, Any] = (
            {"function": baseline.function.to_json()}
            if baseline.function is not None
            else {"entrypoint": list(baseline.entrypoint)}
        )
        run = {"manifest": m.guest_view(), **entry, "timeout_s": 60, "env": {}}
        t0 = time.perf_counter()
        output = await env.run_episode(run, staging / env.env_id, quota_bytes=1 << 24)
        elapsed = time.perf_counter() - t0
    finally:
        assert (await env.aclose()).confirmed_absent
    assert output.exit.exit_code == 0 and output.result_raw, output.exit
    return elapsed


async def warm_rows(
    snap: QemuDriver, tiny: Baseline, runs: int, episodes: int, parallel: tuple[int, ...]
) -> tuple[list[str], list[str]]:
    """The warm baseline's rows (fresh clones, side by side with tiny's) and its episodes/s."""
    warm = resolve_or_build(str(WARM), progress=lambda s, d: print(f"build {s}: {d}"))
    shell = resolve_or_build(str(SHELL), progress=lambda s, d: print(f"build {s}: {d}"))
    spares = QemuDriver(start="snapshot")
    spares.keep_spares(1)
    for baseline in (warm, tiny, shell):  # templates built unless cached; the spares started
        await (await snap.create(request(baseline))).aclose()
        await (await spares.create(request(baseline, spares))).aclose()
    kinds = {"function": warm, "command": tiny, "shell command": shell}
    fresh: dict[str, list[float]] = {kind: [] for kind in kinds}
    ahead: dict[str, list[float]] = {kind: [] for kind in kinds}
    python = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):  # interleaved: machine noise hits all of them alike
            for kind, baseline in kinds.items():
                fresh[kind].append(await timed_episode(snap, baseline, Path(tmp)))
                ahead[kind].append(await timed_episode(spares, baseline, Path(tmp), spare=True))
            python.append((await timed_env(snap, tiny, python=True))["python"])
            print(
                f"warm run {i + 1}/{runs}: function episode {fresh['function'][-1] * 1000:.0f} ms"
            )
    await spares.release_spares()
    rows = [
        *(row(f"clone: {kind} episode answered", fresh[kind], None) for kind in kinds),
        *(row(f"spare clone: {kind} episode answered", ahead[kind], None) for kind in kinds),
        row("clone: then `python3 -c pass` (i)", python, None),
    ]
    rates = []
    for baseline, kind in ((warm, "function"), (tiny, "command"), (shell, "shell command")):
        for p in parallel if kind == "function" else parallel[:1]:
            rate = await episodes_per_s(baseline, episodes, p, "snapshot")
            rates.append(
                f"  {kind} entrypoint, snapshot, parallel {p} "
                f"({RunOptions(parallel=p).spare_count()} spares): {rate['wall']:.2f}/s wall incl. "
                f"run setup, {rate['episodes']:.2f}/s first start -> last finish ({episodes} "
                f"episodes); median provision {rate['provision_s'] * 1000:.0f} ms, run "
                f"{rate['run_s'] * 1000:.0f} ms, export {rate['export_s'] * 1000:.0f} ms"
            )
    return rows, rates


async def burst(driver: QemuDriver, baseline: Baseline, n: int, spares: bool = False) -> float:
    """Seconds until ``n`` clones created at once are ready (``spares``: n spares, settled)."""
    if spares:
        driver.keep_spares(n)
        await (await driver.create(request(baseline, driver))).aclose()  # tops the spares up
        await driver.spares.settled()
    requests = [request(baseline, driver if spares else None) for _ in range(n)]
    t0 = time.perf_counter()
    envs = await asyncio.gather(*(driver.create(r) for r in requests))
    elapsed = time.perf_counter() - t0
    assert all((e.info.spare_s is not None) == spares for e in envs)
    reports = await asyncio.gather(*(env.aclose() for env in envs))
    assert all(r.confirmed_absent for r in reports)
    return elapsed


def pss_kib(env: Env) -> tuple[int, int]:
    """(PSS of the env's QEMU process, PSS of its supervisor processes) in KiB."""
    qemu = other = 0
    for pid in hostproc.pids_with_marker(env.env_id):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        pss = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
        if comm.startswith("qemu-system"):
            qemu += pss
        else:
            other += pss
    return qemu, other


async def idle_pss(driver: QemuDriver, baseline: Baseline, n: int) -> list[tuple[int, int]]:
    envs: list[Env] = []
    try:
        for _ in range(0, n, 4):  # a few at a time: the point is the idle footprint
            envs += await asyncio.gather(*(driver.create(request(baseline)) for _ in range(4)))
        await asyncio.sleep(3.0)
        return [pss_kib(env) for env in envs[:n]]
    finally:
        await asyncio.gather(*(env.aclose() for env in envs))


async def episodes_per_s(
    baseline: Baseline, n: int, parallel: int, start: str, spares: int | None = None
) -> dict[str, float]:
    marks: dict[str, float] = {}

    def on_event(kind: str, data: dict[str, Any]) -> None:
        now = time.perf_counter()
        if kind == "episode_started":
            marks.setdefault("first", now)
        elif kind == "episode_finished":
            marks["last"] = now

    with tempfile.TemporaryDirectory() as tmp, Ledger(Path(tmp) / "ledger.db") as ledger:
        ctl = Controller(
            QemuDriver(start=start),
            ledger,
            LocalStore(Path(tmp) / "store"),
            options=RunOptions(parallel=parallel, staging_dir=Path(tmp) / "staging", spares=spares),
            on_event=on_event,
        )
        t0 = time.perf_counter()
        result = await ctl.run([manifest(i) for i in range(n)], baseline)
        wall = time.perf_counter() - t0
    assert result.counts() == {"completed": n}, result.counts()
    assert not result.leaked_envs
    phases = {
        name: statistics.median((e.record or {})["timings"][name] for e in result.episodes)
        for name in ("provision_s", "run_s", "export_s")
    }
    return {"wall": n / wall, "episodes": n / (marks["last"] - marks["first"]), **phases}


TABLE = Table(("n", "p50", "p95"), name_width=34, n_width=4)
READY_TARGET = "<= 50 ms p50, >= 20x"


def row(name: str, values: list[float], cold_p50: float | None, target: str = "") -> str:
    """A row of ``TABLE``, then its p50 as a ratio to the cold boot's, then the target."""
    p50 = p50_p95(values)[0]
    ratio = f"{cold_p50 * 1000 / p50:>8.1f}x" if cold_p50 else f"{'':>9}"
    return f"{TABLE.row(name, values)} {ratio}  {target}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=int, default=10)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=30)
    parser.add_argument("--idle", type=int, default=20)
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--python", type=int, default=10, help="runs that also time python3")
    parser.add_argument("--warm", type=int, default=10, help="fresh clones per warm row")
    parser.add_argument("--only-warm", action="store_true", help="just the warm rows")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    baseline = resolve_or_build(str(TINY), progress=lambda s, d: print(f"build {s}: {d}"))
    cold, snap = QemuDriver(start="cold"), QemuDriver(start="snapshot")
    spare = QemuDriver(start="snapshot")
    spare.keep_spares(1)
    load_at_start = os.getloadavg()[0]
    if args.only_warm:
        await only_warm(args, snap, baseline, load_at_start)
        return

    t0 = time.perf_counter()
    first = await snap.create(request(baseline))  # builds the template unless cached
    template_s = time.perf_counter() - t0
    await first.aclose()
    template = snapshot.load(snap.template_key(request(baseline), snap.accel))  # type: ignore[arg-type]
    assert template is not None

    cold_runs: list[dict[str, float]] = []
    clone_runs: list[dict[str, float]] = []
    spare_runs: list[dict[str, float]] = []
    await (await spare.create(request(baseline, spare))).aclose()  # starts its first spare
    every = max(args.runs // max(args.cold, 1), 1)
    for i in range(args.runs):
        clone_runs.append(await timed_env(snap, baseline, python=i < args.python))
        spare_runs.append(await timed_env(spare, baseline, python=False, spare=True))
        if i % every == 0 and len(cold_runs) < args.cold:
            cold_runs.append(await timed_env(cold, baseline, python=len(cold_runs) < args.python))
        print(f"run {i + 1}/{args.runs}: clone ready {clone_runs[-1]['ready'] * 1000:.0f} ms")
    while len(cold_runs) < args.cold:
        cold_runs.append(await timed_env(cold, baseline, python=len(cold_runs) < args.python))
    bursts, spare_bursts = [], []
    for i in range(args.bursts):
        bursts.append(await burst(snap, baseline, args.burst))
        spare_bursts.append(await burst(spare, baseline, args.burst, spares=True))
        print(f"burst {i + 1}/{args.bursts}: {args.burst} ready in {bursts[-1] * 1000:.0f} ms")
    await spare.release_spares()
    pss = await idle_pss(snap, baseline, args.idle)
    cold_env = await cold.create(request(baseline))
    await asyncio.sleep(3.0)
    cold_pss = pss_kib(cold_env)
    await cold_env.aclose()
    load_at_episodes = os.getloadavg()[0]
    rates = {p: await episodes_per_s(baseline, args.episodes, p, "snapshot") for p in (2, 4)}
    with_spares = await episodes_per_s(baseline, args.episodes, 2, "snapshot", spares=2)
    cold_rate = await episodes_per_s(baseline, 6, 2, "cold")
    warm_table, warm_rates = await warm_rows(snap, baseline, args.warm, args.episodes, (2, 4))

    cold_p50 = statistics.median(r["ready"] for r in cold_runs)
    qemu_pss = [q / 1024 for q, _ in pss]
    sup_pss = statistics.mean(o for _, o in pss) / 1024
    accel = snap.describe()
    lines = [
        f"# bench/start.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores, qemu {accel.get('accelerator_version', '?')}, "
        f"accelerator {accel.get('accelerator', '?')}, load average (1 min) at the start "
        f"{load_at_start:.1f}, before the episodes {load_at_episodes:.1f}, at the end "
        f"{os.getloadavg()[0]:.1f}",
        f"# template: {template.digest[:19]}…, RAM {template.memory_mib} MiB in "
        f"{template.files['ram']['size'] >> 20} MiB file, device state "
        f"{template.files['state']['size'] >> 10} KiB; first clone (incl. template build if "
        f"not cached) {template_s:.2f} s; template facts: boot {template.facts.get('boot_s')} s,"
        f" save {template.facts.get('save_s')} s",
        f"# cold runs: {len(cold_runs)} (fewer: a boot takes seconds); clone runs: {args.runs}; "
        f"bursts: {args.bursts} x {args.burst}; cold and clone runs alternate",
        "",
        f"{TABLE.header('start path (ms)')} {'vs cold':>9}  target",
        row("cold boot -> agent ready", [r["ready"] for r in cold_runs], None),
        row("cold boot -> first exec answered", [r["exec"] for r in cold_runs], None),
        *(
            line
            for name, runs in (("clone", clone_runs), ("spare clone", spare_runs))
            for line in (
                row(f"{name} -> agent ready", [r["ready"] for r in runs], cold_p50, READY_TARGET),
                row(f"{name} -> first exec answered", [r["exec"] for r in runs], cold_p50),
            )
        ),
        row(f"{args.burst} clones ready at once", bursts, cold_p50, "<= 500 ms"),
        row(f"{args.burst} spare clones ready at once", spare_bursts, cold_p50, "<= 500 ms"),
        row(
            "cold: then `python3 -c pass`", [r["python"] for r in cold_runs if "python" in r], None
        ),
        row(
            "clone: then `python3 -c pass`",
            [r["python"] for r in clone_runs if "python" in r],
            None,
        ),
        row("destroy + confirm (clone)", [r["destroy"] for r in clone_runs], None),
        row("destroy + confirm (cold)", [r["destroy"] for r in cold_runs], None),
        *warm_table,
        "",
        f"PSS with {len(pss)} idle clones alive: QEMU p50 {statistics.median(qemu_pss):.1f} MiB,"
        f" max {max(qemu_pss):.1f} MiB (target <= 32 MiB); supervisor (timeout) "
        f"{sup_pss:.1f} MiB; one idle cold-booted VM: QEMU {cold_pss[0] / 1024:.1f} MiB",
        "",
        "trivial episodes/s end to end (Controller + LocalStore + Ledger, task mode ok):",
    ]
    for parallel, rate in rates.items():
        lines.append(
            f"  snapshot, parallel {parallel} ({RunOptions(parallel=parallel).spare_count()} "
            f"spares): {rate['wall']:.2f}/s wall incl. run setup, "
            f"{rate['episodes']:.2f}/s first start -> last finish ({args.episodes} episodes;"
            f" target >= 15/s); median provision {rate['provision_s'] * 1000:.0f} ms, run "
            f"{rate['run_s'] * 1000:.0f} ms, export {rate['export_s'] * 1000:.0f} ms"
        )
    lines.append(
        f"  snapshot, parallel 2, 2 spares: {with_spares['wall']:.2f}/s wall, "
        f"{with_spares['episodes']:.2f}/s first start -> last finish; median provision "
        f"{with_spares['provision_s'] * 1000:.0f} ms"
    )
    lines.append(
        f"  cold, parallel 2: {cold_rate['wall']:.2f}/s wall, {cold_rate['episodes']:.2f}/s "
        f"episodes (6 episodes)"
    )
    lines += ["", "function entrypoint (the warm baseline) against a command (tiny):", *warm_rates]
    write(args.out or ROOT / "bench" / "results" / "start.txt", lines)


async def only_warm(
    args: argparse.Namespace, snap: QemuDriver, tiny: Baseline, load_at_start: float
) -> None:
    """``--only-warm``: the warm rows, with the command rows they compare against."""
    table, rates = await warm_rows(snap, tiny, args.warm, args.episodes, (2, 4))
    facts = snap.describe()
    lines = [
        f"# bench/start.py --only-warm — {time.strftime('%Y-%m-%d %H:%M')} — "
        f"{platform.node()}, {os.cpu_count()} cores, qemu {facts.get('accelerator_version')}, "
        f"accelerator {facts.get('accelerator')}, load average (1 min) at the start "
        f"{load_at_start:.1f}, at the end {os.getloadavg()[0]:.1f}",
        f"# fresh snapshot clones, {args.warm} of each, interleaved; the function is "
        "tests/baselines/warm (entry:run, json and random pre-imported), the command "
        "tests/baselines/tiny (python3 /opt/tiny/entry.py); both do the same trivial episode "
        "(RUN -> DONE: manifest in, stdout/stderr, an artifact, result.json out); "
        "(i): `python3 -c pass` in a tiny clone after a first `true`, interleaved with them",
        "",
        f"{TABLE.header('start path (ms)')} {'':>9}",
        *table,
        "",
        "trivial episodes/s end to end (Controller + LocalStore + Ledger, task mode ok):",
        *rates,
    ]
    write(args.out or ROOT / "bench" / "results" / "warm.txt", lines)


if __name__ == "__main__":
    asyncio.run(main())
