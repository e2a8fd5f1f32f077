"""Fork benchmark: a group's warm parent, its snapshot, and 8 clones from it.

Measures, on the tiny test baseline, ``--runs`` times (each a new parent):
  parent ready                 template -> warm parent restored (sparse RAM copy, share=on)
  setup                        the group's setup command in the parent (``SETUP``)
  setup-snapshot               SNAPSHOT_PREPARE + save + parent destroyed/confirmed + files frozen
  seal                         the snapshot's hash, in a thread while the clones restore
  8 clones ready               parent-snapshot-done -> all 8 clones ready (restored, and the
                               snapshot sealed and checked unchanged: ``fork.Forks.clone``)
  setup done -> 8 clones ready the two above: what the group waits for after its setup
  reference: 8 template clones ready at once (bench/start.py's burst), same run
  alternative, not used: saving a plain clone (RAM private, share=off) - its RAM goes into the
  migration stream; its clones load it - ``--alt`` runs
  PSS per idle clone, 8 alive: fork clones, template clones, alternative clones
  end to end: a group of 8 through the Controller at parallel 2, forked against the same
  group with the setup run in each episode's own env (a driver without ``fork``)
Results: bench/results/fork.txt.

    python bench/fork.py [--runs 5] [--alt 3] [--note "what this run compares"]
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

from start import pss_kib, request  # bench/start.py (same folder)
from stats import Table, write

import cleanroom.api as cr
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers import snapshot
from cleanroom.drivers.base import Env, new_snapshot_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
SETUP = [  # "copy in a repository and prepare it": a package tree, byte-compiled, imported
    "sh",
    "-c",
    "cp -r /usr/lib/python3.11/json /root/repo && python3 -m compileall -q /root/repo "
    "&& cd /root && python3 -c 'import repo'",
]
CLONES = 8
SNAPSHOT_TARGET_S = 5.0  # a group's setup-snapshot (save + destroy + freeze), end to end


async def close_all(envs: list[Env]) -> None:
    reports = await asyncio.gather(*(env.aclose() for env in envs))
    assert all(r.confirmed_absent for r in reports), reports


async def fork_run(driver: QemuDriver, baseline: Baseline) -> dict[str, float]:
    sid = new_snapshot_id()
    t0 = time.perf_counter()
    parent = await driver.fork_parent(request(baseline), sid)
    t1 = time.perf_counter()
    try:
        (await parent.exec(SETUP, timeout_s=300)).check()
        t2 = time.perf_counter()
        snap = await driver.fork_save(parent, sid)
        t3 = time.perf_counter()
        clones = await asyncio.gather(
            *(driver.fork_clone(request(baseline), snap) for _ in range(CLONES))
        )
        t4 = time.perf_counter()
        snap = await driver.fork_sealed(snap)  # done: every clone waited for it
        await asyncio.sleep(2.0)
        pss = statistics.median(pss_kib(c)[0] for c in clones) / 1024
        await close_all(list(clones))
    finally:
        await parent.aclose()
        assert await driver.delete_snapshot(sid)
    facts = snap.facts
    return {
        "parent": t1 - t0,
        "setup": t2 - t1,
        "snapshot": t3 - t2,
        "save": facts["save_s"],
        "seal": facts["seal_s"],
        "clones": t4 - t3,
        "to_clones": t4 - t2,
        "pss": pss,
        "state_kib": facts["state_bytes"] / 1024,
        "ram_mib": facts["ram_bytes"] / 2**20,
    }


async def template_burst(driver: QemuDriver, baseline: Baseline) -> dict[str, float]:
    t0 = time.perf_counter()
    envs = await asyncio.gather(*(driver.create(request(baseline)) for _ in range(CLONES)))
    elapsed = time.perf_counter() - t0
    await asyncio.sleep(2.0)
    pss = statistics.median(pss_kib(e)[0] for e in envs) / 1024
    await close_all(list(envs))
    return {"clones": elapsed, "pss": pss}


async def alternative_run(driver: QemuDriver, baseline: Baseline, work: Path) -> dict[str, float]:
    """Save a plain clone (share=off): the whole RAM goes into the stream. Not what fork does."""
    env = await driver.create(request(baseline))
    folder = work / new_snapshot_id()
    folder.mkdir()
    try:
        (await env.exec(SETUP, timeout_s=300)).check()
        t0 = time.perf_counter()
        await env.session.snapshot_prepare()
        live = driver._live[env.env_id]
        qmp = await live.open_qmp()
        fd = os.open(folder / snapshot.STATE_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            await snapshot.save(qmp, fd)
        finally:
            os.close(fd)
        saved = time.perf_counter() - t0
    finally:
        await env.aclose()
    memory = request(baseline).limits.memory_mib
    with (folder / snapshot.RAM_FILE).open("wb") as f:  # an empty file: pages come from the stream
        f.truncate(memory << 20)
    fake = snapshot.Template("alt", folder, "sha256:alt", memory, {}, {})
    assert driver.accel is not None
    t1 = time.perf_counter()
    clones = await asyncio.gather(
        *(
            driver.cloner.clone(request(baseline), driver.accel, fake, time.monotonic(), None)
            for _ in range(CLONES)
        )
    )
    elapsed = time.perf_counter() - t1
    await asyncio.sleep(2.0)
    pss = statistics.median(pss_kib(c)[0] for c in clones) / 1024
    await close_all(list(clones))
    state_mib = (folder / snapshot.STATE_FILE).stat().st_size / 2**20
    return {"save": saved, "state_mib": state_mib, "clones": elapsed, "pss": pss}


class NoFork(QemuDriver):
    """The same driver without the capability: each episode runs the setup itself."""

    capabilities = QemuDriver.capabilities - {"fork"}


async def end_to_end(baseline: Baseline, driver: QemuDriver) -> dict[str, Any]:
    episodes = [
        {"episode_id": f"e2e-{i}", "seed": i, "policy": {"id": "bench"}, "task": {"mode": "ok"}}
        for i in range(CLONES)
    ]
    batch = cr.group("e2e", {"command": SETUP, "timeout_s": 300}, episodes)
    with tempfile.TemporaryDirectory() as tmp, Ledger(Path(tmp) / "ledger.db") as ledger:
        ctl = Controller(
            driver,
            ledger,
            LocalStore(Path(tmp) / "store"),
            options=RunOptions(parallel=2, staging_dir=Path(tmp) / "staging"),
        )
        t0 = time.perf_counter()
        result = await ctl.run(batch, baseline)
        wall = time.perf_counter() - t0
    assert result.counts() == {"completed": CLONES}, result.counts()
    assert not result.leaked_envs
    provision = statistics.median(
        (e.record or {})["timings"]["provision_s"] for e in result.episodes
    )
    return {"wall": wall, "provision": provision, "group": result.groups[0]}


TABLE = Table(("n", "p50", "p95"), name_width=44, unit="ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--alt", type=int, default=3)
    parser.add_argument("--note", default="", help="a header line saying what the run is for")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fork.txt")
    args = parser.parse_args()
    baseline = resolve_or_build(str(TINY), progress=lambda s, d: print(f"build {s}: {d}"))
    driver = QemuDriver(start="snapshot")
    load_at_start = os.getloadavg()[0]
    await (await driver.create(request(baseline))).aclose()  # the template exists now

    forks, bursts, alts = [], [], []
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as work:
        for i in range(args.runs):
            forks.append(await fork_run(driver, baseline))
            bursts.append(await template_burst(driver, baseline))
            if i < args.alt:
                alts.append(await alternative_run(driver, baseline, Path(work)))
            print(f"run {i + 1}/{args.runs}: {forks[-1]}")
    load_e2e = os.getloadavg()[0]
    forked = await end_to_end(baseline, driver)
    per_episode = await end_to_end(baseline, NoFork(start="snapshot"))

    accel = driver.describe()
    f = {key: [r[key] for r in forks] for key in forks[0]}
    g = forked["group"]
    lines = [
        f"# bench/fork.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
        f"{os.cpu_count()} cores, qemu {accel.get('accelerator_version', '?')}, accelerator "
        f"{accel.get('accelerator', '?')}, load average (1 min) at the start {load_at_start:.1f}, "
        f"before end to end {load_e2e:.1f}, at the end {os.getloadavg()[0]:.1f}",
        f"# setup: {' '.join(SETUP[2:])}",
        f"# {args.runs} groups (a new parent each) of {CLONES} clones; template bursts interleaved;"
        f" {len(alts)} runs of the alternative",
        *([f"# {args.note}"] if args.note else []),
        "",
        TABLE.header("(p50, p95)"),
        TABLE.row("template -> warm parent ready", f["parent"]),
        TABLE.row("setup in the parent", f["setup"]),
        TABLE.row("setup-snapshot (prepare+save+destroy+freeze)", f["snapshot"]),
        TABLE.row("  of which: save (migrate device state)", f["save"]),
        TABLE.row("seal: hash RAM + state (as clones restore)", f["seal"]),
        TABLE.row(f"parent-snapshot-done -> {CLONES} clones ready", f["clones"]),
        TABLE.row(f"setup done -> {CLONES} clones ready", f["to_clones"]),
        TABLE.row(f"reference: {CLONES} template clones ready", [b["clones"] for b in bursts]),
        TABLE.row("alternative: save a plain clone", [a["save"] for a in alts]),
        TABLE.row(f"alternative: {CLONES} of its clones ready", [a["clones"] for a in alts]),
        "",
        f"snapshot size: device state {statistics.median(f['state_kib']):.0f} KiB, RAM file "
        f"{statistics.median(f['ram_mib']):.0f} MiB allocated (sparse copy of the template's + "
        f"what the setup wrote); alternative: stream "
        f"{statistics.median(a['state_mib'] for a in alts):.0f} MiB",
        f"PSS per idle clone ({CLONES} alive, QEMU): fork {statistics.median(f['pss']):.1f} MiB, "
        f"template {statistics.median(b['pss'] for b in bursts):.1f} MiB, alternative "
        f"{statistics.median(a['pss'] for a in alts):.1f} MiB",
        "",
        f"end to end, a group of {CLONES} (task mode ok) through the Controller, parallel 2:",
        f"  forked: {forked['wall']:.1f} s wall (parent {g.timings['parent_s']:.2f} s, setup "
        f"{g.timings['setup_s']:.2f} s once, snapshot {g.timings['snapshot_s']:.2f} s); median "
        f"provision {forked['provision'] * 1000:.0f} ms",
        f"  target: snapshot < {SNAPSHOT_TARGET_S:.0f} s: "
        f"{'met' if g.timings['snapshot_s'] < SNAPSHOT_TARGET_S else 'MISSED'}",
        f"  setup in each episode's env: {per_episode['wall']:.1f} s wall; median provision "
        f"(create + setup) {per_episode['provision'] * 1000:.0f} ms",
    ]
    write(args.out, lines)


if __name__ == "__main__":
    asyncio.run(main())
